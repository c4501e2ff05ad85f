"""One generation request as the scheduler sees it: token ids, progress, status.

There is no prefill phase and no decode phase, only `num_computed_tokens`
catching up with `num_tokens` (prompt + outputs so far). A request whose
computed count reaches its token count samples one new token; a request that
is preempted drops its KV cache, sets `num_computed_tokens` back to 0 and is
recomputed later over prompt + outputs, keeping the outputs it already sent.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from carpool.lora_request import LoRARequest
from carpool.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: every status from FINISHED_STOPPED on is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """The `finish_reason` the OpenAI API reports, None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)  # a request is itself, not its field values: list.remove compares by identity
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    eos_token_id: int | None = None
    # Hard cap from the model: prompt + outputs never exceed this.
    max_model_len: int | None = None

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # The token id that ended the request via stop_token_ids / a stop string, if any.
    stop_reason: int | str | None = None
    # Prefix caching: blocks hash only with blocks of the same salt (tenants apart).
    cache_salt: str | None = None
    # The LoRA adapter it runs under (None: the base model); its id also keys its blocks.
    lora_request: LoRARequest | None = None
    # Chained hashes of its full blocks so far, filled by the block manager (prefix caching).
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # Prompt tokens found in the prefix cache when first admitted (None until admitted).
    num_cached_tokens: int | None = None

    # Timestamps for metrics (same clock as arrival_time).
    queued_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if self.queued_time is None:
            self.queued_time = self.arrival_time

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether every prompt position must run through the model (prompt logprobs), so no
        prompt block may come from the prefix cache."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + outputs: what the KV cache must eventually hold."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_output_tokens(self) -> int | None:
        """The tighter of `max_tokens` and what `max_model_len` leaves after the prompt."""
        limit = self.sampling_params.max_tokens  # read on every token: no list, no min()
        if self.max_model_len is not None:
            room = self.max_model_len - len(self.prompt_token_ids)
            if limit is None or room < limit:
                limit = room
        return limit

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + outputs, without copying the rest.

        |<-- prompt_token_ids -->|<-- output_token_ids -->|
        0                  num_prompt_tokens          num_tokens
        """
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason
