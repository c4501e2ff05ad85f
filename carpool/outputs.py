"""What the engine hands back: per-step deltas, and vLLM-shaped final outputs.

`LLMEngine.step()` returns one `StepOutput` per request that advanced: only the
*new* tokens and text of that step, so streaming never copies a whole
context. `LLM.generate` folds deltas into `RequestOutput` / `CompletionOutput`,
the shapes vLLM users know.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# One output position: token id -> Logprob, holding the chosen token and the top-N.
PositionLogprobs = dict[int, Logprob]


@dataclass(frozen=True)
class PromptLogprobs:
    """The model's logprob of prompt tokens `start, start + 1, ...`, each given the tokens
    before it (float32 log-softmax of the raw logits), its rank (1 = most likely), and the
    top-N alternatives. The runner makes one per prefill chunk; joined, they cover positions
    1 .. P-1 (the first prompt token follows nothing, so has none, as in vLLM)."""

    start: int  # position of token_ids[0] in the prompt
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]
    top_token_ids: tuple[tuple[int, ...], ...]  # per token, most likely first
    top_logprobs: tuple[tuple[float, ...], ...]

    @property
    def end(self) -> int:
        """The position after the last token covered."""
        return self.start + len(self.token_ids)

    def join(self, later: PromptLogprobs) -> PromptLogprobs:
        """These and the contiguous `later` (which must start at `self.end`) as one."""
        if later.start != self.end:
            raise ValueError(f"prompt logprobs at {later.start} do not follow {self.end}")
        return PromptLogprobs(self.start, self.token_ids + later.token_ids,
                              self.logprobs + later.logprobs, self.ranks + later.ranks,
                              self.top_token_ids + later.top_token_ids,
                              self.top_logprobs + later.top_logprobs)

    def starting_at(self, position: int) -> PromptLogprobs:
        """The part from `position` on (which must lie within start .. end)."""
        if not self.start <= position <= self.end:
            raise ValueError(f"position {position} is outside {self.start} .. {self.end}")
        i = position - self.start
        return PromptLogprobs(position, self.token_ids[i:], self.logprobs[i:], self.ranks[i:],
                              self.top_token_ids[i:], self.top_logprobs[i:])

    def positions(self) -> list[PositionLogprobs | None]:
        """vLLM's `RequestOutput.prompt_logprobs`: None for each position before `start`, then
        {token id: Logprob} holding the prompt's token and the top-N."""
        result: list[PositionLogprobs | None] = [None] * self.start
        for i, token_id in enumerate(self.token_ids):
            entry: PositionLogprobs = {token_id: Logprob(self.logprobs[i], rank=self.ranks[i])}
            for rank, (top_id, value) in enumerate(zip(self.top_token_ids[i],
                                                       self.top_logprobs[i]), 1):
                entry.setdefault(top_id, Logprob(value, rank=rank))
            result.append(entry)
        return result


@dataclass(frozen=True)
class RequestMetrics:
    """One finished request's timeline (engine clock, time.monotonic), preemptions, and the
    output cap it ran under; what the request histograms of `carpool.metrics` are made of."""

    arrival_time: float
    first_scheduled_time: float | None  # None: finished (aborted) before it was scheduled
    first_token_time: float | None
    finished_time: float
    num_preemptions: int
    last_token_time: float | None = None
    # max_tokens, or what max_model_len leaves after the prompt when unset (vLLM's param)
    max_tokens: int | None = None


@dataclass(frozen=True)
class EngineStats:
    """`LLMEngine.stats()`: counters since start, the last step's shape, the queues and cache."""

    num_steps: int  # steps that ran the model
    num_generated_tokens: int  # output tokens sampled and returned
    num_prompt_tokens: int  # prompt tokens of requests that produced their first token
    last_step_num_tokens: int
    last_step_num_prefill_tokens: int
    last_step_num_decode_tokens: int
    num_preemptions: int
    # Prompt tokens looked up in / found in the prefix cache, at each request's first admission
    # (0 with caching off).
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use, 0-1
    num_paused: int = 0  # unfinished requests held back because their reader is behind
    # Speculative decoding since start (vLLM's spec_decode_* counters): drafts verified, their
    # tokens, the tokens accepted, and accepted by position in the draft (0 = first).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # A mixture of experts with `moe_router_stats`: rows each expert received since start, per
    # sparse layer (a step's top-k pairs, so each layer's sum is top_k x tokens); else None.
    router_load: tuple[tuple[int, ...], ...] | None = None
    # LoRA adapters (with enable_lora): unfinished requests per adapter name, running or
    # waiting; max_loras; adapters read from disk and dropped since start; bytes loaded now.
    lora_running: dict = field(default_factory=dict)
    lora_waiting: dict = field(default_factory=dict)
    max_lora: int = 0
    lora_loads: int = 0
    lora_evictions: int = 0
    lora_loaded_bytes: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


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
    # The whole prompt's, on the request's first output only, when asked (prompt_logprobs).
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why, when finish_reason == "error"
    # "grammar_error": the request's own grammar failed (a 400, not the engine's 500); else None
    error_code: str | None = None
    request_metrics: RequestMetrics | None = None  # on the finishing output only

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
    # One per completion (n of them), in index order; None for a completion not finished.
    metrics: list[RequestMetrics | None] = field(default_factory=list)
    # Prompt tokens served from the prefix cache (the most any completion found).
    num_cached_tokens: int = 0
    # vLLM's: None for the first prompt token, then {token id: Logprob} per prompt token;
    # None unless SamplingParams.prompt_logprobs was set.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
