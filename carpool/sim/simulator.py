"""Drive a real scheduler through a workload on a simulated clock.

The loop is the engine's (schedule -> "run the model" -> update) with the
model replaced by the cost model: a step of N batched tokens (padding
included) advances the clock by `a + b * N` seconds, and every request that
samples gets token 1 (never EOS, so requests end by their length). Arrivals
join the scheduler when the clock passes them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from carpool.core.config import SchedulerConfig
from carpool.core.kv_fit import cdiv
from carpool.core.request import Request
from carpool.core.scheduler import Scheduler
from carpool.core.static_scheduler import StaticScheduler
from carpool.sampling_params import SamplingParams
from carpool.sim.timeline import SlotTracker, StepRecord
from carpool.sim.workload import Scenario

FAKE_TOKEN_ID = 1
SCHEDULER_CLASSES = {"static": StaticScheduler, "continuous": Scheduler}


@dataclass(frozen=True)
class SimSettings:
    """Scheduler knobs the simulator exposes; the rest are SchedulerConfig's defaults."""

    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_blocks: int | None = None  # None: enough for every slot at the longest request
    preemption_policy: str = "newest"


@dataclass(frozen=True)
class SimResult:
    kind: str
    finish_s: dict[str, float]
    latency_s: dict[str, float]
    total_s: float
    num_output_tokens: int
    num_steps: int
    num_preemptions: int
    num_padding_tokens: int
    steps: tuple[StepRecord, ...]

    @property
    def mean_latency_s(self) -> float:
        return sum(self.latency_s.values()) / len(self.latency_s)

    @property
    def throughput_tok_s(self) -> float:
        return self.num_output_tokens / self.total_s

    @property
    def slot_utilisation(self) -> float:
        """Fraction of slot-time spent on a request that had not ended (idle gaps: unused)."""
        num_slots = len(self.steps[0].cells)
        busy = sum((s.end_s - s.start_s) * sum(c.active for c in s.cells) for s in self.steps)
        return busy / (num_slots * self.total_s)


class _SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now = round(self.now + seconds, 9)  # keeps 200 x 0.05 at exactly 10.0


def build_scheduler(kind: str, scenario: Scenario, settings: SimSettings, clock: _SimClock):
    max_len = max(r.num_prompt_tokens + r.num_output_tokens for r in scenario.requests)
    num_blocks = settings.num_blocks or scenario.num_slots * cdiv(max_len, settings.block_size)
    config = SchedulerConfig(
        max_num_seqs=scenario.num_slots, max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=max_len, block_size=settings.block_size,
        preemption_policy=settings.preemption_policy, scheduler=kind,
        # Every simulated prompt is the same placeholder token: caching would share them all.
        enable_prefix_caching=False)
    return SCHEDULER_CLASSES[kind](config, num_blocks, clock=clock)


def simulate(kind: str, scenario: Scenario, settings: SimSettings = SimSettings()) -> SimResult:
    """Run the whole scenario through the `kind` scheduler ("static" or "continuous")."""
    clock = _SimClock()
    scheduler = build_scheduler(kind, scenario, settings, clock)
    pending = deque(sorted(scenario.requests, key=lambda r: r.arrival_s))
    requests: dict[str, Request] = {}
    seats = SlotTracker(scenario.num_slots)
    steps: list[StepRecord] = []
    ended: set[str] = set()
    num_padding = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0].arrival_s <= clock.now:
            request = _to_request(pending.popleft())
            requests[request.request_id] = request
            scheduler.add_request(request)
        if not scheduler.has_unfinished_requests():
            clock.now = pending[0].arrival_s
            continue
        output = scheduler.schedule()
        if output.is_empty:
            raise RuntimeError(f"{kind} scheduler scheduled nothing at t={clock.now:.3f}s "
                               f"with {len(requests) - len(ended)} requests unfinished")
        seats.release(output.preempted_ids)
        seats.seat([s.request_id for s in output.scheduled])
        cells = seats.cells(ended)
        start = clock.now
        num_padding += output.num_padding_tokens
        clock.advance(scenario.cost.step_seconds(output.num_scheduled_tokens
                                                 + output.num_padding_tokens))
        steps.append(StepRecord(start, clock.now, cells))
        sampled = {s.request_id: FAKE_TOKEN_ID for s in output.scheduled if s.sample}
        for request in scheduler.update(output, sampled):
            if request.is_finished:
                ended.add(request.request_id)
        _release_ended(seats, ended, hold_until_batch_end=(kind == "static"))
    return _result(kind, scheduler, requests, steps, num_padding)


def _to_request(item) -> Request:
    return Request(item.request_id, [FAKE_TOKEN_ID] * item.num_prompt_tokens,
                   SamplingParams(max_tokens=item.num_output_tokens, temperature=0.0),
                   arrival_time=item.arrival_s)


def _release_ended(seats: SlotTracker, ended: set[str], hold_until_batch_end: bool) -> None:
    seated = seats.seated_ids
    if not hold_until_batch_end:
        seats.release([s for s in seated if s in ended])
    elif all(s in ended for s in seated):
        seats.release(seated)


def _result(kind: str, scheduler, requests: dict[str, Request], steps: list[StepRecord],
            num_padding: int) -> SimResult:
    finish = {rid: r.finished_time for rid, r in requests.items()}
    return SimResult(
        kind=kind,
        finish_s=finish,
        latency_s={rid: r.finished_time - r.arrival_time for rid, r in requests.items()},
        total_s=max(finish.values()),
        num_output_tokens=sum(r.num_output_tokens for r in requests.values()),
        num_steps=len(steps),
        num_preemptions=scheduler.num_preemptions_total,
        num_padding_tokens=num_padding,
        steps=tuple(steps),
    )
