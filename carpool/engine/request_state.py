"""What `LLMEngine` keeps per live request beside the scheduler's `Request`: its
detokenizer (and whether it runs only at the finish), how many output tokens were
already sent, the prompt logprobs gathered chunk by chunk, and its grammar matcher."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from carpool.core.request import Request
from carpool.engine.detokenizer import IncrementalDetokenizer
from carpool.outputs import PromptLogprobs, RequestMetrics


@dataclass
class RequestState:
    """What the engine keeps per live request beside the scheduler's `Request`."""

    request: Request
    detokenizer: IncrementalDetokenizer | None  # None: text is the front end's job
    num_sent_tokens: int = 0  # output tokens already returned in a StepOutput
    # Prompt logprobs gathered chunk by chunk (prompt_logprobs requests), until first sent.
    prompt_logprobs: PromptLogprobs | None = None
    matcher: Any = None  # the grammar's llguidance matcher when structured_outputs is set
    # Decode the whole output once, in the output that finishes the request (no stop strings).
    text_at_finish: bool = False

    def cut_output(self, new_token_ids: list[int], num_kept: int | None) -> list[int]:
        """Keep only the first `num_kept` of this step's new tokens (None: all): a stop string
        ended the output at that one (speculative decoding emitted several in one step)."""
        if num_kept is None:
            return new_token_ids
        outputs = self.request.output_token_ids
        del outputs[len(outputs) - len(new_token_ids) + num_kept:]
        self.num_sent_tokens = len(outputs)
        return new_token_ids[:num_kept]

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Join one prefill chunk's share. After a preemption the prompt is computed again,
        in chunks that may straddle what is held: only positions not held yet are kept."""
        held = self.prompt_logprobs
        needed = 1 if held is None else held.end
        if not chunk.start <= needed < chunk.end:
            return
        tail = chunk.starting_at(needed)
        self.prompt_logprobs = tail if held is None else held.join(tail)

    def first_prompt_logprobs(self, first: bool) -> PromptLogprobs | None:
        """The prompt logprobs a request's first output carries (when it asked for them)."""
        if not first or self.request.sampling_params.prompt_logprobs is None:
            return None
        # a one-token prompt scores nothing: vLLM's [None]
        return self.prompt_logprobs or PromptLogprobs(1, (), (), (), (), ())


def request_metrics(request: Request, clock: Callable[[], float]) -> RequestMetrics:
    """The request's timings for its last output; its finish time is now if not set yet."""
    if request.finished_time is None:
        request.finished_time = clock()
    return RequestMetrics(
        arrival_time=request.arrival_time, first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time, finished_time=request.finished_time,
        num_preemptions=request.num_preemptions, last_token_time=request.last_token_time,
        max_tokens=request.max_output_tokens)
