"""What the engine hands back: per-step deltas, and vLLM-shaped final outputs.

`LLMEngine.step()` returns one `StepOutput` per request that advanced: only the
*new* tokens and text of that step, so streaming never copies a whole
context. `LLM.generate` folds deltas into `RequestOutput` / `CompletionOutput`,
the shapes vLLM users know.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# One output position: token id -> Logprob, holding the chosen token and the top-N.
PositionLogprobs = dict[int, Logprob]


@dataclass
class StepOutput:
    """What one engine step says about one request: a delta."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int  # total so far, including new_token_ids
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    new_logprobs: list[PositionLogprobs] | None = None  # one per new token, when asked
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why, when finish_reason == "error"
    # Set on the finishing output only: arrival_time, first_scheduled_time, first_token_time,
    # finished_time (engine clock, time.monotonic) and num_preemptions, for metrics.
    request_metrics: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: dict = field(default_factory=dict)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (most of any completion)
