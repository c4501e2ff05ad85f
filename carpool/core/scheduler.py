"""The continuous-batching scheduler: the batch is re-formed every step.

There is no prefill phase and no decode phase: each request's
`num_computed_tokens` catches up with its `num_tokens` (prompt + outputs)
under one token budget per step. `schedule()` plans a step in three passes:

  1. running requests that are decoding: 1 token each, oldest first;
  2. running requests part-way through their prompt: the next chunk each;
  3. waiting requests, first come first served, while the budget,
     `max_num_seqs`, free KV blocks and the partial-prefill limits allow.
     One that does not fit is skipped, at most `max_skips` times (aging).

A running request that needs a KV block when none is free preempts the
victim named by `preemption_policy` (possibly itself): the victim's blocks
are freed and it goes back to the front of the queue to be recomputed.
No waiting request is admitted in a step that preempted one.
`update()` then takes the sampled tokens back and finishes requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from carpool.core.admission import PartialPrefillSlots, prefill_chunk
from carpool.core.block_manager import BlockManager
from carpool.core.config import SchedulerConfig
from carpool.core.preemption import get_victim_policy
from carpool.core.request import Request, RequestStatus
from carpool.core.request_table import RequestTable
from carpool.core.scheduler_output import SchedulerOutput
from carpool.core.step_plan import StepPlan


class Scheduler(RequestTable):
    def __init__(self, config: SchedulerConfig, num_blocks: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, BlockManager(num_blocks, config.block_size), clock)
        self._running: list[Request] = []  # admission order, oldest first
        self._prefill_ends: dict[str, int] = {}  # num_tokens the current prefill must reach
        self._num_skips: dict[str, int] = {}
        self._choose_victim = get_victim_policy(config.preemption_policy)
        self.num_preemptions_total = 0

    @property
    def num_running(self) -> int:
        return len(self._running)

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Changes block tables, running/waiting membership and preemptions;
        `num_computed_tokens` moves only in `update()`."""
        plan = StepPlan(self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted_ids:
            self._admit_waiting(plan)
        return plan.to_output(self.block_manager, self._take_finished_ids())

    # -- pass 1 and 2: running requests ------------------------------------------------------

    def _is_prefilling(self, request: Request) -> bool:
        return request.num_computed_tokens < self._prefill_ends[request.request_id]

    def _schedule_running(self, plan: StepPlan) -> None:
        decoding = [r for r in self._running if not self._is_prefilling(r)]
        prefilling = [r for r in self._running if self._is_prefilling(r)]
        for request in decoding + prefilling:
            if plan.token_budget == 0:
                return
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this pass
            num_remaining = request.num_tokens - request.num_computed_tokens
            num_new = prefill_chunk(num_remaining, plan.token_budget, self.config)
            if num_new and self._grow_or_preempt(request, num_new, plan):
                plan.add(request, num_new)

    def _grow_or_preempt(self, request: Request, num_new: int, plan: StepPlan) -> bool:
        """Give the request blocks for `num_new` more tokens, preempting victims until they fit.

        Returns False when the request had to preempt itself.
        """
        num_tokens = request.num_computed_tokens + num_new
        while not self.block_manager.can_allocate(request.request_id, num_tokens):
            victim = self._choose_victim(self._running)
            self._preempt(victim, plan)
            if victim is request:
                return False
        self.block_manager.allocate(request.request_id, num_tokens)
        return True

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Free the request's blocks and send it to the front of the queue for recompute."""
        plan.remove(request.request_id)
        plan.preempted_ids.append(request.request_id)
        self.block_manager.free(request.request_id)
        self._running.remove(request)
        del self._prefill_ends[request.request_id]
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._waiting.appendleft(request)

    # -- pass 3: admission -------------------------------------------------------------------

    def _partial_slots_after_running(self, plan: StepPlan) -> PartialPrefillSlots:
        slots = PartialPrefillSlots(self.config)
        for request in self._running:
            end = self._prefill_ends[request.request_id]
            if request.num_computed_tokens + plan.num_new_tokens(request.request_id) < end:
                slots.take(end)
        return slots

    def _admit_waiting(self, plan: StepPlan) -> None:
        slots = self._partial_slots_after_running(plan)
        passed_over: list[Request] = []
        for request in list(self._waiting):
            if len(self._running) >= self.config.max_num_seqs or plan.token_budget == 0:
                return
            num_new = self._admission_chunk(request, plan, slots)
            if num_new:
                for skipped in passed_over:
                    self._num_skips[skipped.request_id] = self._num_skips.get(skipped.request_id,
                                                                              0) + 1
                passed_over.clear()
                self._admit(request, num_new, plan, slots)
            elif self._num_skips.get(request.request_id, 0) >= self.config.max_skips:
                return  # aged: nothing behind it is admitted until it fits
            else:
                passed_over.append(request)

    def _admission_chunk(self, request: Request, plan: StepPlan,
                         slots: PartialPrefillSlots) -> int:
        """Tokens the waiting request would take if admitted now; 0 if it does not fit."""
        num_prompt = request.num_tokens  # a recomputed request's "prompt" includes its outputs
        num_new = prefill_chunk(num_prompt, plan.token_budget, self.config)
        if num_new < num_prompt and not slots.can_take(num_prompt):
            return 0
        if num_new and not self.block_manager.can_allocate(request.request_id, num_new):
            return 0
        return num_new

    def _admit(self, request: Request, num_new: int, plan: StepPlan,
               slots: PartialPrefillSlots) -> None:
        self.block_manager.allocate(request.request_id, num_new)
        self._waiting.remove(request)
        self._running.append(request)
        self._prefill_ends[request.request_id] = request.num_tokens
        self._num_skips.pop(request.request_id, None)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self._clock()
        if num_new < request.num_tokens:
            slots.take(request.num_tokens)
        plan.add(request, num_new)

    # -- leaving ----------------------------------------------------------------------------

    def _remove(self, request: Request) -> None:
        if request.status == RequestStatus.RUNNING:
            self._running.remove(request)
            del self._prefill_ends[request.request_id]
        else:
            self._waiting.remove(request)
            self._num_skips.pop(request.request_id, None)
