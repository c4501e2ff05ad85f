"""The baseline: request-level (static) batching, as Hugging Face `generate` does it.

Up to `max_num_seqs` waiting requests are seated together, first come first
served, and only when no batch is running. The whole batch prefills in one
step (padded to its longest prompt; the token budget does not apply), then
decodes one token per member per step until every member has ended. A member
that ends early is reported finished at once (its blocks are freed, its output
cut at its own end) but keeps its seat, computed as padding, until the batch
ends: that waste and the queue behind it are what continuous batching removes.

A batch is seated only if the KV pool can hold every member's prompt plus its
maximum output, so it never needs preemption.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from carpool.core.block_manager import BlockManager
from carpool.core.config import SchedulerConfig
from carpool.core.request import Request, RequestStatus
from carpool.core.request_table import RequestTable
from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput


class StaticScheduler(RequestTable):
    def __init__(self, config: SchedulerConfig, num_blocks: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, BlockManager(num_blocks, config.block_size), clock)
        self._batch: list[Request] = []  # seated members, ended ones included, until all end
        self.num_preemptions_total = 0  # static batching never preempts

    @property
    def num_running(self) -> int:
        return sum(1 for request in self._batch if not request.is_finished)

    @property
    def seated_request_ids(self) -> list[str]:
        """The current batch's members in seat order, ended ones included."""
        return [request.request_id for request in self._batch]

    def schedule(self) -> SchedulerOutput:
        """Plan one step: seat a new batch if the last one ended, then prefill it whole
        or decode 1 token per unfinished member. Changes block tables and seating."""
        if self.num_running == 0:
            self._batch = self._seat_batch()
        scheduled = [self._schedule_member(request)
                     for request in self._batch if not request.is_finished]
        return SchedulerOutput(scheduled=scheduled, finished_ids=self._take_finished_ids(),
                               num_padding_tokens=self._num_padding_tokens())

    def _seat_batch(self) -> list[Request]:
        """Take waiting requests FCFS while seats and the KV pool (at their maximum size) allow."""
        batch: list[Request] = []
        num_reserved_blocks = 0
        while self._waiting and len(batch) < self.config.max_num_seqs:
            request = self._waiting[0]
            num_blocks = self.block_manager.num_blocks_for(
                request.num_prompt_tokens + request.max_output_tokens)
            if num_reserved_blocks + num_blocks > self.block_manager.num_free_blocks:
                break
            num_reserved_blocks += num_blocks
            self._waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.first_scheduled_time = self._clock()
            batch.append(request)
        return batch

    def _schedule_member(self, request: Request) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = request.num_tokens  # the whole prompt on the first step, then 1 token
        block_ids = self.block_manager.allocate(request.request_id, end)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_ids_slice(start, end),
            num_computed_tokens=start,
            block_ids=block_ids,
            sample=True,
            sampling_params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
        )

    def _num_padding_tokens(self) -> int:
        """Tokens computed and thrown away this step: each seat's row is as wide as the
        longest prompt on the prefill step and 1 token after; ended members are all padding."""
        if not self._batch:
            return 0
        is_prefill_step = any(request.num_computed_tokens == 0 for request in self._batch
                              if not request.is_finished)
        row_width = max(r.num_prompt_tokens for r in self._batch) if is_prefill_step else 1
        num_real = 0
        for request in self._batch:
            if not request.is_finished:
                num_real += request.num_tokens - request.num_computed_tokens
        return row_width * len(self._batch) - num_real

    def pause_requests(self, request_ids: Iterable[str]) -> None:
        """Ignored: the baseline runs its batch to the end, as static batching does."""

    def _remove(self, request: Request) -> None:
        if request.status == RequestStatus.WAITING:
            self._waiting.remove(request)
        # a seated member keeps its seat until the batch ends
