"""What one scheduler step decided, as plain ids and ints for the model runner.

The runner builds its packed batch from this alone: for each scheduled request
the token ids to feed, where they start, its block table, and whether the
last of them produces a sampled token. Nothing here is a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from carpool.lora_request import LoRARequest
from carpool.sampling_params import SamplingParams

# A draft token a draft model proposes in the runner, in the step itself (method
# `draft_model`): the scheduler plans k of these, the runner replaces them before the forward.
DRAFT_SLOT = -1


@dataclass(frozen=True, init=False)
class ScheduledRequest:
    request_id: str
    # Tokens fed this step: positions [num_computed_tokens, num_computed_tokens + len(token_ids)).
    token_ids: Sequence[int]
    num_computed_tokens: int  # tokens already in the KV cache before this step
    block_ids: Sequence[int]  # the request's whole block table after this step's allocation
    # True when this chunk reaches the end of prompt + outputs, so a token is sampled;
    # False for a prefill chunk that stops part-way through the prompt.
    sample: bool
    sampling_params: SamplingParams
    # Read-only views of the request's tokens, for penalties (do not mutate).
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    # Speculative decoding: the last len(draft_token_ids) of token_ids are proposed tokens, not
    # the request's own; each of the last 1 + len(draft_token_ids) rows gets logits, and the
    # runner keeps the drafts its samples confirm (then one token of its own).
    draft_token_ids: Sequence[int] = ()
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)

    def __init__(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                 block_ids: Sequence[int], sample: bool, sampling_params: SamplingParams,
                 prompt_token_ids: Sequence[int] = (),
                 output_token_ids: Sequence[int] = (),
                 draft_token_ids: Sequence[int] = (),
                 lora_request: LoRARequest | None = None) -> None:
        # One is built per scheduled request per step. The generated frozen __init__ sets each
        # field through object.__setattr__ (2.1 µs here); filling __dict__ takes 0.7 µs, and
        # assignment still raises FrozenInstanceError.
        fields = self.__dict__
        fields["request_id"] = request_id
        fields["token_ids"] = token_ids
        fields["num_computed_tokens"] = num_computed_tokens
        fields["block_ids"] = block_ids
        fields["sample"] = sample
        fields["sampling_params"] = sampling_params
        fields["prompt_token_ids"] = prompt_token_ids
        fields["output_token_ids"] = output_token_ids
        fields["draft_token_ids"] = draft_token_ids
        fields["lora_request"] = lora_request

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_logits_rows(self) -> int:
        """Rows of this request whose logits the step samples: 0, 1, or 1 + its drafts."""
        return 1 + len(self.draft_token_ids) if self.sample else 0


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests whose KV blocks were freed this step to make room (recomputed later).
    preempted_ids: list[str] = field(default_factory=list)
    # Requests that ended since the previous step (finished, aborted, failed):
    # the runner drops any per-request state it keeps for them.
    finished_ids: list[str] = field(default_factory=list)
    # Extra tokens the static baseline computes and throws away (padding to the
    # batch's longest prompt, and slots of members that already finished), so it
    # pays the same cost Hugging Face `generate` pays. Always 0 when continuous.
    num_padding_tokens: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
