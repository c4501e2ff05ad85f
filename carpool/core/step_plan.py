"""The step being planned: which requests get how many tokens, under what budget.

The scheduler fills a `StepPlan` while it walks running and waiting requests;
preemption can take an entry back out (refunding its tokens), so the plan
stays a mapping until `to_output` turns it into the runner's `SchedulerOutput`.
A speculating decode carries draft tokens after its one token: they spend budget, but
`num_new_tokens` (what the step surely computes, which block hashing covers) leaves them out.
"""

from __future__ import annotations

from collections import Counter

from carpool.core.block_manager import BlockManager
from carpool.core.request import Request
from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput


class StepPlan:
    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget  # tokens still free this step
        # id -> (request, num new tokens, draft tokens after them)
        self._entries: dict[str, tuple[Request, int, list[int]]] = {}
        self.preempted_ids: list[str] = []
        self.adapters: Counter[int] = Counter()  # LoRA adapter id -> its requests in the plan

    def add(self, request: Request, num_new_tokens: int, draft_token_ids: list[int] = ()) -> None:
        """Schedule `num_new_tokens` of the request (then its drafts), spending that much budget."""
        num_fed = num_new_tokens + len(draft_token_ids)
        if not 0 < num_new_tokens <= num_fed <= self.token_budget:
            raise ValueError(f"cannot schedule {num_fed} tokens with "
                             f"{self.token_budget} left in the budget")
        self._entries[request.request_id] = (request, num_new_tokens, draft_token_ids)
        self.token_budget -= num_fed
        if request.lora_request is not None:
            self.adapters[request.lora_request.lora_int_id] += 1

    def remove(self, request_id: str) -> None:
        """Take a request back out (it was preempted), refunding its tokens; no-op if absent."""
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self.token_budget += entry[1] + len(entry[2])
            lora_id = entry[0].lora_int_id
            if lora_id:
                self.adapters[lora_id] -= 1
                if not self.adapters[lora_id]:
                    del self.adapters[lora_id]

    def adapter_full(self, request: Request, max_loras: int | None) -> bool:
        """Whether the request's LoRA adapter would be one more than `max_loras` distinct
        adapters in this step (never for a base request, nor with no limit)."""
        lora_id = request.lora_int_id
        return (max_loras is not None and lora_id != 0 and lora_id not in self.adapters
                and len(self.adapters) >= max_loras)

    def num_new_tokens(self, request_id: str) -> int:
        entry = self._entries.get(request_id)
        return entry[1] if entry is not None else 0

    def to_output(self, block_manager: BlockManager, finished_ids: list[str]) -> SchedulerOutput:
        scheduled = []
        for request, num_new_tokens, drafts in self._entries.values():  # every row, every step
            start = request.num_computed_tokens
            end = start + num_new_tokens
            token_ids = request.token_ids_slice(start, end)
            if drafts:
                token_ids = token_ids + drafts
            scheduled.append(ScheduledRequest(
                request.request_id, token_ids, start,
                block_manager.get_block_table(request.request_id), end == request.num_tokens,
                request.sampling_params, request.prompt_token_ids, request.output_token_ids,
                drafts, request.lora_request))
        return SchedulerOutput(scheduled=scheduled, preempted_ids=list(self.preempted_ids),
                               finished_ids=finished_ids)
