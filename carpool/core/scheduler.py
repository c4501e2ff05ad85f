"""The continuous-batching scheduler: the batch is re-formed every step.

There is no prefill phase and no decode phase: each request's
`num_computed_tokens` catches up with its `num_tokens` (prompt + outputs)
under one token budget per step. `schedule()` plans a step in three passes:

  1. running requests that are decoding: 1 token each, oldest first;
  2. running requests part-way through their prompt: the next chunk each;
  3. waiting requests, first come first served, while the budget,
     `max_num_seqs`, free KV blocks and the partial-prefill limits allow.
     One that does not fit is skipped, at most `max_skips` times (aging).
     A request on a LoRA adapter beyond `max_loras` distinct ones in the step
     waits (running or not) without aging or holding back those behind it.
     With prefix caching, a request's tokens already in cached blocks count
     as computed when it is admitted: only the rest is charged against the
     budget and the partial-prefill limits. A block a step is planned to fill
     gets its hash before the next lookup (or when its request leaves), so a
     request admitted after it in the same step already hits it: that step
     writes the block's K/V before any of its attention reads it (every layer
     stores the whole step's K/V first), as vLLM's V1 scheduler does. A
     request whose next uncached block a running prefill computes in a
     *later* step waits for it (it will hit) rather than compute it a second
     time.

Paused requests (their client stopped reading: `pause_requests`) are left out
of every pass and do not hold a seat; they keep their blocks until a running
request needs one. A resumed request whose seat was taken meanwhile runs again
oldest first: a step never schedules more than `max_num_seqs` requests.

A running request that needs a KV block when none is free preempts a paused
request first, then a resumed one still without a seat (neither runs this
step), then the victim named by `preemption_policy` (possibly itself): the
victim's blocks are freed and it goes back to the front of the queue to be
recomputed.
No waiting request is admitted in a step that preempted one.
`update()` then takes the sampled tokens back and finishes requests.

With speculative decoding (`speculative`), a decode may carry draft tokens from the
`Speculator` (the one place that decides who drafts how many): it is scheduled for 1 + k
tokens and its blocks for all of them are taken before the step runs, so verification never
allocates; a draft that does not fit the free blocks is dropped, never a reason to preempt.
Only the accepted drafts become computed tokens (`update`); the rejected ones' slots are
overwritten by later steps and never hashed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from carpool.core.admission import PartialPrefillSlots, prefill_chunk
from carpool.core.block_manager import BlockManager, NoFreeBlocksError
from carpool.core.config import SchedulerConfig
from carpool.core.preemption import get_victim_policy
from carpool.core.request import Request, RequestStatus
from carpool.core.request_table import RequestTable
from carpool.core.scheduler_output import SchedulerOutput
from carpool.core.spec_config import SpeculativeConfig
from carpool.core.speculator import Speculator
from carpool.core.step_plan import StepPlan


class Scheduler(RequestTable):
    def __init__(self, config: SchedulerConfig, num_blocks: int,
                 clock: Callable[[], float] = time.monotonic,
                 speculative: SpeculativeConfig | None = None) -> None:
        block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        super().__init__(config, block_manager, clock)
        self._running: list[Request] = []  # admission order, oldest first
        # The positions the current prefill computes: from the end of its cached prefix to
        # num_tokens at admission (prompt, plus outputs when recomputed after preemption).
        self._prefills: dict[str, range] = {}
        self._num_skips: dict[str, int] = {}
        # Prefix caching: running requests that filled (or are planned to fill) a block since
        # their blocks were last hashed. Hashed together when a lookup or a free needs them.
        self._unhashed: dict[str, Request] = {}
        self._choose_victim = get_victim_policy(config.preemption_policy)
        self.num_preemptions_total = 0
        self.speculator = Speculator(speculative) if speculative is not None else None

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

    def _schedule_running(self, plan: StepPlan) -> None:
        # A resumed request may find its seat taken: at most max_num_seqs run in a step (oldest
        # first); the rest keep their blocks and wait for a seat.
        seated = ([r for r in self._running if r.request_id not in self._paused]
                  if self._paused else self._running)
        unseated = seated[self.config.max_num_seqs:]  # hold blocks, do not run this step
        decoding, prefilling = [], []
        prefills = self._prefills
        for request in seated[:self.config.max_num_seqs]:
            (prefilling if request.num_computed_tokens < prefills[request.request_id].stop
             else decoding).append(request)
        speculator, num_seated = self.speculator, min(len(seated), self.config.max_num_seqs)
        max_loras = self.config.max_loras
        for request in decoding + prefilling:
            if plan.token_budget == 0:
                return
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this pass
            if plan.adapter_full(request, max_loras):
                continue  # keeps its blocks; runs when its adapter has a place
            computed = request.num_computed_tokens
            num_remaining = request.num_tokens - computed
            if speculator is not None and num_remaining == 1 and self._schedule_draft(
                    request, speculator.propose(request, num_seated, plan.token_budget), plan):
                continue
            # a decode's one token always fits the budget left (> 0) and any chunk cap
            num_new = 1 if num_remaining == 1 else prefill_chunk(num_remaining,
                                                                 plan.token_budget, self.config)
            if num_new and self._grow_or_preempt(request, num_new, plan, unseated):
                plan.add(request, num_new)
                self._note_filled_blocks(request, computed, num_new)

    def _schedule_draft(self, request: Request, drafts: list[int], plan: StepPlan) -> bool:
        """Schedule the decode with its drafts if the free blocks hold them all (False: none,
        or they do not fit; the plain decode follows)."""
        if not drafts:
            return False
        computed = request.num_computed_tokens
        try:
            self.block_manager.allocate(request.request_id, computed + 1 + len(drafts))
        except NoFreeBlocksError:
            return False
        plan.add(request, 1, drafts)
        self._note_filled_blocks(request, computed, 1)
        return True

    def update(self, scheduler_output: SchedulerOutput, sampled_token_ids: Mapping[str, int],
               accepted_draft_ids: Mapping[str, Sequence[int]] | None = None,
               num_draft_tokens: Mapping[str, int] | None = None) -> list[Request]:
        produced = super().update(scheduler_output, sampled_token_ids, accepted_draft_ids)
        if self.speculator is not None and accepted_draft_ids is not None:
            for scheduled in scheduler_output.scheduled:
                if not scheduled.draft_token_ids or scheduled.request_id not in sampled_token_ids:
                    continue
                # the drafts the runner verified (not told: those planned): a draft model's
                # slots a grammar cut are no drafts, and one cut to none was a plain decode
                num_drafted = (num_draft_tokens or {}).get(scheduled.request_id,
                                                           len(scheduled.draft_token_ids))
                if not num_drafted:
                    continue
                num_accepted = len(accepted_draft_ids.get(scheduled.request_id, ()))
                request = self._requests.get(scheduled.request_id)  # None: it finished
                self.speculator.record(scheduled.request_id, num_drafted, num_accepted,
                                       running=request is not None)
                if num_accepted and request is not None:  # accepted drafts may have filled
                    # a block: hashed by the next lookup or free
                    self._note_filled_blocks(request, scheduled.num_computed_tokens,
                                             1 + num_accepted)
        return produced

    def _grow_or_preempt(self, request: Request, num_new: int, plan: StepPlan,
                         unseated: list[Request]) -> bool:
        """Give the request blocks for `num_new` more tokens, preempting victims until they fit:
        paused requests, then `unseated` ones (both idle this step; preempted ones leave the
        list), and only then one the policy picks among all running, possibly this one.

        Returns False when the request had to preempt itself.
        """
        num_tokens = request.num_computed_tokens + num_new
        while True:
            try:  # most steps: the table has room, or the pool has the blocks
                self.block_manager.allocate(request.request_id, num_tokens)
                return True
            except NoFreeBlocksError:
                pass  # nothing changed: make room
            paused = [r for r in self._running if r.request_id in self._paused]
            if paused:
                victim = paused[-1]
            elif unseated:
                # Never the policy over all running here: it could pick a seated request (even
                # this one) and leave the step with nothing scheduled, the unseated one idle.
                victim = self._choose_victim(unseated)
                unseated.remove(victim)
            else:
                victim = self._choose_victim(self._running)
            self._preempt(victim, plan)
            if victim is request:
                return False

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Free the request's blocks and send it to the front of the queue for recompute."""
        plan.remove(request.request_id)
        plan.preempted_ids.append(request.request_id)
        self._hash_computed_blocks(request)  # (its planned ones are not computed now)
        self.block_manager.free(request.request_id)
        self._running.remove(request)
        del self._prefills[request.request_id]
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._waiting.appendleft(request)

    # -- pass 3: admission -------------------------------------------------------------------

    def _partial_slots_after_running(self, plan: StepPlan) -> PartialPrefillSlots:
        slots = PartialPrefillSlots(self.config)
        for request in self._running:
            if request.request_id in self._paused:
                continue
            prefill = self._prefills[request.request_id]
            if request.num_computed_tokens + plan.num_new_tokens(request.request_id) < prefill.stop:
                slots.take(len(prefill))
        return slots

    def _admit_waiting(self, plan: StepPlan) -> None:
        num_seated = (sum(1 for r in self._running if r.request_id not in self._paused)
                      if self._paused else len(self._running))
        if num_seated >= self.config.max_num_seqs or plan.token_budget == 0 or not self._waiting:
            return  # no seat, no budget or no one waiting: skip the per-running-request passes
        slots = self._partial_slots_after_running(plan)
        in_flight = self._in_flight_block_hashes()
        passed_over: list[Request] = []
        for request in list(self._waiting):
            if num_seated >= self.config.max_num_seqs or plan.token_budget == 0:
                return
            if request.request_id in self._paused or plan.adapter_full(request,
                                                                       self.config.max_loras):
                continue
            self._hash_planned_blocks(plan)  # before the lookup: it may hit them
            cached_block_ids, num_new = self._admission_chunk(request, plan, slots, in_flight)
            if num_new:
                for skipped in passed_over:
                    self._num_skips[skipped.request_id] = self._num_skips.get(skipped.request_id,
                                                                              0) + 1
                passed_over.clear()
                self._admit(request, cached_block_ids, num_new, plan, slots)
                num_seated += 1
                self._add_in_flight(in_flight, request)
            elif self._num_skips.get(request.request_id, 0) >= self.config.max_skips:
                return  # aged: nothing behind it is admitted until it fits
            else:
                passed_over.append(request)

    def _admission_chunk(self, request: Request, plan: StepPlan, slots: PartialPrefillSlots,
                         in_flight: set[bytes]) -> tuple[list[int], int]:
        """The cached blocks the waiting request would start with, and the tokens it would
        compute if admitted now (0 if it does not fit, or should wait for a block in flight).

            |<- cached blocks ->|<- num_new ->|<- later chunks ->|
            0              num_cached                      num_tokens
        """
        # Prompt logprobs need the logits of every prompt position: no cache hits (vLLM's rule).
        cached_block_ids = [] if request.needs_prompt_logits else \
            self.block_manager.find_cached_blocks(request)
        next_block = len(cached_block_ids)  # the first it could hit next, if any
        if (in_flight and not request.needs_prompt_logits
                and next_block < (request.num_tokens - 1) // self.config.block_size
                and request.block_hashes[next_block] in in_flight):
            return cached_block_ids, 0
        num_cached = len(cached_block_ids) * self.config.block_size
        # a recomputed request's "prompt" includes its outputs
        num_uncached = request.num_tokens - num_cached
        num_new = prefill_chunk(num_uncached, plan.token_budget, self.config)
        if num_new < num_uncached and not slots.can_take(num_uncached):
            return cached_block_ids, 0
        if num_new and not self.block_manager.can_allocate(
                request.request_id, num_cached + num_new, cached_block_ids):
            return cached_block_ids, 0
        return cached_block_ids, num_new

    def _admit(self, request: Request, cached_block_ids: list[int], num_new: int,
               plan: StepPlan, slots: PartialPrefillSlots) -> None:
        num_cached = len(cached_block_ids) * self.config.block_size
        self.block_manager.allocate(request.request_id, num_cached + num_new, cached_block_ids)
        self._waiting.remove(request)
        self._running.append(request)
        prefill = range(num_cached, request.num_tokens)
        self._prefills[request.request_id] = prefill
        self._num_skips.pop(request.request_id, None)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        if request.first_scheduled_time is None:  # first admission, not a re-admission
            request.first_scheduled_time = self._clock()
            request.num_cached_tokens = num_cached
            if self.block_manager.prefix_cache is not None:
                self.prefix_cache_stats.record(request.num_tokens, num_cached)
        if num_new < len(prefill):
            slots.take(len(prefill))
        plan.add(request, num_new)
        self._note_filled_blocks(request, num_cached, num_new)

    # -- prefix caching: blocks in flight ---------------------------------------------------

    def _note_filled_blocks(self, request: Request, computed: int, num_new: int) -> None:
        """Note the request if its `num_new` planned tokens after `computed` fill a block (with
        caching on): its blocks get their hashes by the next lookup or free, not now.

        Most decode steps fill none. A step that does usually has no lookup after it (a
        lookup comes with an admission), so the hashing of several steps runs together, on a
        warm cache, instead of one cold sha256 call in each step that fills a block."""
        size = self.config.block_size
        if (self.block_manager.prefix_cache is not None
                and (computed + num_new) // size > computed // size):
            self._unhashed[request.request_id] = request

    def _hash_planned_blocks(self, plan: StepPlan) -> None:
        """Hash the full blocks of the noted requests up to the end of this step's plan, so
        that a request looked up next hits them. Every full block a step writes has its hash
        before any later lookup: that step writes its K/V before any of its attention reads
        it (every layer stores the whole step's K/V first)."""
        for request_id, request in self._unhashed.items():
            self.block_manager.cache_full_blocks(
                request, request.num_computed_tokens + plan.num_new_tokens(request_id))
        self._unhashed.clear()

    def _hash_computed_blocks(self, request: Request) -> None:
        """Before a request's blocks are freed: hash its computed full blocks not hashed yet,
        so that they stay in the prefix cache."""
        if self._unhashed.pop(request.request_id, None) is not None:
            self.block_manager.cache_full_blocks(request, request.num_computed_tokens)

    def _in_flight_block_hashes(self) -> set[bytes]:
        """Hashes of the full blocks that running prefills have yet to compute (none with
        caching off): a waiting request whose next uncached block is one of them waits. (Those
        this step computes are hashed already, so a request hits them before asking.)"""
        hashes: set[bytes] = set()
        if self.block_manager.prefix_cache is not None and self._waiting:
            for request in self._running:
                if request.request_id not in self._paused:
                    self._add_in_flight(hashes, request)
        return hashes

    def _add_in_flight(self, hashes: set[bytes], request: Request) -> None:
        if self.block_manager.prefix_cache is None:
            return
        first = request.num_computed_tokens // self.config.block_size
        last = self._prefills[request.request_id].stop // self.config.block_size
        if first < last:
            hashes.update(self.block_manager.block_hashes(request, last)[first:last])

    # -- leaving ----------------------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        """Forget every hash, and the blocks noted for hashing: a failed step's planned blocks
        must never get one (those computed earlier simply miss the cache)."""
        self._unhashed.clear()
        return super().reset_prefix_cache()

    def _remove(self, request: Request) -> None:
        self._hash_computed_blocks(request)  # it leaves; _finish frees its blocks next
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        if request.status == RequestStatus.RUNNING:
            self._running.remove(request)
            del self._prefills[request.request_id]
        else:
            self._waiting.remove(request)
            self._num_skips.pop(request.request_id, None)
