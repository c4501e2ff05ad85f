"""What every scheduler does the same way: admit-time checks, sampled tokens, stopping, finishing.

`Scheduler` and `StaticScheduler` differ only in how they pick a step's
requests; both keep their unfinished requests in a `RequestTable`, which
rejects requests that could never run, appends sampled tokens, applies the
stop rules and frees a finished request's blocks in the same call.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from carpool.core.block_manager import BlockManager
from carpool.core.config import SchedulerConfig
from carpool.core.kv_fit import check_fits_pool
from carpool.core.prefix_cache import PrefixCacheStats
from carpool.core.request import Request, RequestStatus
from carpool.core.scheduler_output import SchedulerOutput


def stop_status(request: Request, token_id: int) -> RequestStatus | None:
    """The finished status the just-appended `token_id` puts the request in, if any.

    EOS (unless ignore_eos) and stop_token_ids count only once `min_tokens`
    outputs exist; a stop token is recorded in `request.stop_reason`.
    """
    params = request.sampling_params
    num_output_tokens = len(request.output_token_ids)  # read for every token: no properties
    if num_output_tokens >= params.min_tokens:
        if (not params.ignore_eos and request.eos_token_id is not None
                and token_id == request.eos_token_id):
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
    if num_output_tokens >= request.max_output_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None


class RequestTable:
    """Base of the schedulers: owns the unfinished requests and the block manager."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float]) -> None:
        self.config = config
        self.block_manager = block_manager
        self._clock = clock
        self._requests: dict[str, Request] = {}  # unfinished only
        self._finished_ids: list[str] = []  # since the last schedule()
        self._waiting: deque[Request] = deque()
        # Requests whose client stopped reading (flow control): not scheduled until resumed.
        # Only the continuous scheduler honours it; the static baseline ignores it.
        self._paused: set[str] = set()
        self.prefix_cache_stats = PrefixCacheStats()  # stays 0 where the block manager has no cache

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def requests_by_adapter(self) -> tuple[dict[str, int], dict[str, int]]:
        """(running, waiting) unfinished requests per LoRA adapter name (base ones left out);
        preempted and paused requests count as waiting."""
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for request in self._requests.values():
            if request.lora_request is not None:
                into = running if (request.status == RequestStatus.RUNNING
                                   and request.request_id not in self._paused) else waiting
                name = request.lora_request.lora_name
                into[name] = into.get(name, 0) + 1
        return running, waiting

    def add_request(self, request: Request) -> None:
        """Queue a request (status WAITING); raises ValueError if it could never run."""
        self._register(request)
        self._waiting.append(request)

    def update(self, scheduler_output: SchedulerOutput, sampled_token_ids: Mapping[str, int],
               accepted_draft_ids: Mapping[str, Sequence[int]] | None = None,
               num_draft_tokens: Mapping[str, int] | None = None) -> list[Request]:
        """Advance the scheduled requests, append their sampled tokens, finish (and free) the
        ones that stop. Returns the requests that received a token, in schedule order.

        `accepted_draft_ids`: for a request scheduled with drafts, those verified (a prefix of
        them); they are appended before its sampled token, one at a time under the stop rules,
        so a stop among them ends the request there and drops the rest.
        `num_draft_tokens`: for the same requests, how many drafts the runner verified (a
        draft model's, cut by a grammar, may fill fewer than their slots); a speculating
        scheduler counts those (`Scheduler.update`), this table needs only the tokens."""
        return self._apply_step(scheduler_output, sampled_token_ids, accepted_draft_ids or {})

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests now (abort, error, stop string): frees their blocks, sets status and
        finished_time. Unknown or already-finished ids are ignored. Returns those it ended."""
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status.name}")
        finished = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is not None:
                self._finish(request, status)
                finished.append(request)
        return finished

    def pause_requests(self, request_ids: Iterable[str]) -> None:
        """Stop scheduling these requests (their reader is behind) until `resume_requests`.

        A paused request keeps its blocks but not its seat: it does not count toward
        `max_num_seqs`, and it is the first victim when a running request needs a block.
        Unknown or finished ids are ignored.
        """
        self._paused.update(rid for rid in request_ids if rid in self._requests)

    def resume_requests(self, request_ids: Iterable[str]) -> None:
        """Schedule these paused requests again; unknown or unpaused ids are ignored."""
        self._paused.difference_update(request_ids)

    @property
    def num_paused(self) -> int:
        return len(self._paused)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block hash (see `BlockManager.reset_prefix_cache`)."""
        return self.block_manager.reset_prefix_cache()

    # -- for subclasses ---------------------------------------------------------------------

    def _register(self, request: Request) -> None:
        """Validate a new request and start tracking it (status WAITING, queued_time now)."""
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        max_model_len = self.config.max_model_len
        if request.max_model_len is not None:
            max_model_len = min(max_model_len, request.max_model_len)
        if request.num_prompt_tokens + 1 > max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; with at least 1 output token "
                f"that exceeds max_model_len ({max_model_len})")
        request.max_model_len = max_model_len
        check_fits_pool(request.num_prompt_tokens, request.max_output_tokens,
                        self.block_manager.block_size, self.block_manager.num_total_blocks)
        request.status = RequestStatus.WAITING
        request.queued_time = self._clock()
        self._requests[request.request_id] = request

    def _apply_step(self, scheduler_output: SchedulerOutput, sampled_token_ids: Mapping[str, int],
                    accepted_draft_ids: Mapping[str, Sequence[int]]) -> list[Request]:
        produced = []
        now = self._clock()  # the step's tokens all arrive now
        for scheduled in scheduler_output.scheduled:
            request = self._requests.get(scheduled.request_id)
            if request is None:
                continue  # finished (aborted) between schedule() and update()
            if request.num_computed_tokens != scheduled.num_computed_tokens:
                raise ValueError(f"stale SchedulerOutput for {scheduled.request_id!r}: it was "
                                 f"planned at {scheduled.num_computed_tokens} computed tokens, "
                                 f"the request has {request.num_computed_tokens}")
            # (the blocks this fills were hashed when the step was planned: `Scheduler`)
            num_fed = len(scheduled.token_ids)
            if scheduled.draft_token_ids:
                accepted = accepted_draft_ids.get(scheduled.request_id, ())
                num_fed += len(accepted) - len(scheduled.draft_token_ids)
            request.num_computed_tokens += num_fed
            if scheduled.sample:
                if scheduled.request_id not in sampled_token_ids:
                    raise ValueError(f"no sampled token for {scheduled.request_id!r}")
                if scheduled.draft_token_ids:
                    for token_id in accepted:
                        self._append_token(request, token_id, now)
                        if request.is_finished:
                            break
                if not request.is_finished:
                    self._append_token(request, sampled_token_ids[scheduled.request_id], now)
                produced.append(request)
        return produced

    def _append_token(self, request: Request, token_id: int, now: float) -> None:
        request.output_token_ids.append(token_id)
        request.last_token_time = now
        if request.first_token_time is None:
            request.first_token_time = request.last_token_time
        status = stop_status(request, token_id)
        if status is not None:
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self._remove(request)
        self._paused.discard(request.request_id)
        request.status = status
        request.finished_time = self._clock()
        self.block_manager.free(request.request_id)
        del self._requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def _take_finished_ids(self) -> list[str]:
        finished_ids, self._finished_ids = self._finished_ids, []
        return finished_ids

    def _remove(self, request: Request) -> None:
        """Take an unfinished request out of the subclass's queues (status not yet changed)."""
        raise NotImplementedError
