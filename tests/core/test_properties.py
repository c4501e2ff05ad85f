"""Random configs x random workloads: DESIGN.md's invariants hold after every step.

Each example drives a real scheduler the way the engine does (arrivals between
steps, aborts at random points, EOS now and then) and checks, after every
step, against its own bookkeeping rather than the scheduler's: the token
budget, max_num_seqs, block integrity, the partial-prefill limits, progress
(`num_computed_tokens` as reported), FCFS with bounded skipping, and at the
end that every request finished and every block is free.

Prompts share prefixes (a few families that diverge at random points, two
cache salts), so prefix caching hits, shares blocks and evicts. The test keeps
its own model of what each KV slot holds (which salt and token prefix was
written there) and checks that every step reads, in every slot before its
chunk, exactly its own prefix, and writes only blocks no one else holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carpool.core.config import SchedulerConfig
from carpool.core.request import Request, RequestStatus
from carpool.core.scheduler import Scheduler
from carpool.core.static_scheduler import StaticScheduler
from carpool.sampling_params import SamplingParams

EOS = 0
MAX_STEPS = 20_000
SETTINGS = settings(max_examples=200, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def configs(draw, tiny_pool: bool = False) -> tuple[SchedulerConfig, int]:
    max_model_len = draw(st.integers(4, 48))
    chunked = draw(st.booleans())
    budget = draw(st.integers(max_model_len if not chunked else 1, 64))
    num_partial = draw(st.integers(1, 4))
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        max_num_partial_prefills=num_partial,
        max_long_partial_prefills=draw(st.integers(1, num_partial)),
        long_prefill_token_threshold=draw(st.integers(0, 24)),
        block_size=draw(st.sampled_from([1, 2, 4, 8, 16])),
        preemption_policy=draw(st.sampled_from(["newest", "least_work"])),
        max_skips=draw(st.integers(0, 4)),
        enable_prefix_caching=draw(st.booleans()),
    )
    min_blocks = -(-max_model_len // config.block_size)  # the longest request fits alone
    extra = draw(st.integers(0, 2 if tiny_pool else 4 * min_blocks))
    return config, min_blocks + extra


@dataclass
class Spec:
    arrival_step: int
    num_prompt_tokens: int
    max_tokens: int
    min_tokens: int
    eos_every: int  # the fake sampler emits EOS every this many tokens (0: never)
    family: int = 0  # prompts of one family agree up to `diverge_at`
    diverge_at: int = 0
    cache_salt: str | None = None


@st.composite
def workloads(draw, max_model_len: int, uniform: bool = False) -> list[Spec]:
    num_requests = draw(st.integers(1, 24))
    shape = (draw(st.integers(1, max_model_len - 1)),)
    specs = []
    for _ in range(num_requests):
        prompt = shape[0] if uniform else draw(st.integers(1, max_model_len - 1))
        max_tokens = (max_model_len - prompt if uniform
                      else draw(st.integers(1, max_model_len - prompt)))
        specs.append(Spec(
            arrival_step=0 if uniform else draw(st.integers(0, 12)),
            num_prompt_tokens=prompt, max_tokens=max_tokens,
            min_tokens=0 if uniform else draw(st.integers(0, max_tokens)),
            eos_every=0 if uniform else draw(st.sampled_from([0, 0, 3, 5])),
            family=0 if uniform else draw(st.integers(0, 2)),
            diverge_at=0 if uniform else draw(st.integers(0, max_model_len)),
            cache_salt=None if uniform else draw(st.sampled_from([None, None, "tenant-b"]))))
    return specs


@dataclass
class Observer:
    """The test's own bookkeeping of what the scheduler has told it."""

    config: SchedulerConfig
    max_passes: int  # steps in which a waiting request may be passed over (aging)
    computed: dict[str, int] = field(default_factory=dict)  # id -> tokens the KV cache holds
    partial: dict[str, int] = field(default_factory=dict)  # id -> prefill length, part-way ones
    added: list[str] = field(default_factory=list)
    first_scheduled: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)  # the queue as the test models it
    num_passed_over: dict[str, int] = field(default_factory=dict)  # since last admitted
    admitted_now: set[str] = field(default_factory=set)
    prefill_len: dict[str, int] = field(default_factory=dict)  # uncached tokens at admission
    # What the test believes each KV slot holds: (cache salt, token ids of positions 0..p).
    slots: dict[tuple[int, int], tuple] = field(default_factory=dict)
    hashed_before: set[int] = field(default_factory=set)  # blocks with a hash before schedule()
    evicted: set[int] = field(default_factory=set)  # blocks whose hash schedule() dropped
    starts: dict[str, int] = field(default_factory=dict)  # this step: id -> first computed token

    def check_step(self, scheduler, output) -> None:
        ids = [s.request_id for s in output.scheduled]
        assert len(ids) == len(set(ids))
        assert not set(ids) & set(output.preempted_ids), "a preempted request was scheduled"
        assert scheduler.num_running <= self.config.max_num_seqs
        assert len(ids) <= self.config.max_num_seqs
        scheduler.block_manager.check_integrity()
        for rid in output.preempted_ids:
            self.computed[rid] = 0
            self.partial.pop(rid, None)
            self.waiting.insert(0, rid)
        self._note_admissions(ids)
        for rid, count in self.num_passed_over.items():
            assert count <= self.max_passes, \
                f"{rid} was passed over in {count} steps, at most {self.max_passes} allowed"
        holders: dict[int, list[str]] = {}
        for rid in scheduler._requests:
            for block_id in scheduler.block_manager.get_block_table(rid):
                holders.setdefault(block_id, []).append(rid)
        self.starts = {s.request_id: s.num_computed_tokens for s in output.scheduled}
        for scheduled in output.scheduled:
            self._check_scheduled(scheduler, scheduled, holders)

    def check_continuous(self, output) -> None:
        assert output.num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert output.num_padding_tokens == 0
        threshold = self.config.effective_long_prefill_threshold
        assert len(self.partial) <= self.config.max_num_partial_prefills
        num_long = sum(1 for n in self.partial.values() if threshold and n > threshold)
        assert num_long <= self.config.max_long_partial_prefills
        for s in output.scheduled:
            if not self.config.enable_chunked_prefill and s.request_id in self.admitted_now:
                assert s.sample, "without chunked prefill a prompt is scheduled whole"
            if self.config.enable_chunked_prefill and threshold and s.num_new_tokens > 1:
                assert s.num_new_tokens <= threshold

    def add(self, rid: str) -> None:
        self.added.append(rid)
        self.waiting.append(rid)

    def forget(self, rid: str) -> None:
        self.partial.pop(rid, None)
        self.prefill_len.pop(rid, None)
        self.num_passed_over.pop(rid, None)
        if rid in self.waiting:
            self.waiting.remove(rid)

    def _check_scheduled(self, scheduler, scheduled, holders) -> None:
        rid = scheduled.request_id
        request = scheduler.get_request(rid)
        start = scheduled.num_computed_tokens
        size = self.config.block_size
        if rid in self.admitted_now:  # starts after its cached prefix, never at its last token
            assert start % size == 0 and start <= (request.num_tokens - 1) // size * size
            assert start == 0 or self.config.enable_prefix_caching
            self.prefill_len[rid] = request.num_tokens - start
        else:
            assert start == self.computed.get(rid, 0)
        end = start + scheduled.num_new_tokens
        tokens = request.prompt_token_ids + request.output_token_ids
        assert list(scheduled.token_ids) == tokens[start:end]
        assert scheduled.sample == (end == request.num_tokens)
        assert len(scheduled.block_ids) * size >= end
        assert list(scheduled.block_ids) == scheduler.block_manager.get_block_table(rid)
        self._check_kv(scheduler, request, scheduled, tokens, holders)
        self.computed[rid] = end
        if scheduled.sample:
            self.partial.pop(rid, None)
        else:
            self.partial[rid] = self.prefill_len[rid]

    def _check_kv(self, scheduler, request, scheduled, tokens, holders) -> None:
        """Reads see the request's own prefix; a block is written in one step only, by one
        request: never a block hashed before this step, and any other table holding it
        starts its computation after it (shares it, reads it after this step's writes);
        then the model records what was written."""
        size = self.config.block_size
        table = scheduled.block_ids
        start = scheduled.num_computed_tokens
        end = start + scheduled.num_new_tokens
        prefixes = [(request.cache_salt,)]  # prefixes[p + 1]: salt and tokens 0..p
        for token_id in tokens[:end]:
            prefixes.append(prefixes[-1] + (token_id,))
        for p in range(start):
            assert self.slots.get((table[p // size], p % size)) == prefixes[p + 1], \
                f"{request.request_id} reads a slot at position {p} holding another prefix"
        for index in range(start // size, -(-end // size)):
            block = table[index]
            for other in holders[block]:
                if other != request.request_id:
                    assert self.starts.get(other, 0) >= (index + 1) * size, \
                        f"write into block {block}, which {other} also computes"
            assert block not in self.hashed_before or block in self.evicted, \
                f"write into block {block}, hashed before this step"
        for p in range(start, end):
            self.slots[(table[p // size], p % size)] = prefixes[p + 1]
    def _note_admissions(self, ids: list[str]) -> None:
        """Admissions must follow the queue (preempted requests at its front, then arrivals),
        and each request may be passed over by a later one in at most max_skips steps."""
        admitted = [rid for rid in ids if rid in self.waiting]
        self.admitted_now = set(admitted)
        positions = [self.waiting.index(rid) for rid in admitted]
        assert positions == sorted(positions), f"admitted out of queue order: {admitted}"
        if admitted:
            for rid in self.waiting[:positions[-1]]:
                if rid not in admitted:
                    self.num_passed_over[rid] = self.num_passed_over.get(rid, 0) + 1
        for rid in admitted:
            self.waiting.remove(rid)
            self.num_passed_over.pop(rid, None)
            if rid not in self.first_scheduled:
                self.first_scheduled.append(rid)


def drive(scheduler, config: SchedulerConfig, specs: list[Spec], abort_steps: list[int],
          continuous: bool) -> tuple[dict[str, Request], Observer]:
    """Run the workload to the end, checking every step; fails on a livelock."""
    requests: dict[str, Request] = {}
    eos_every: dict[str, int] = {}
    pending = sorted(enumerate(specs), key=lambda item: item[1].arrival_step)
    # static batching seats strictly first come first served: no request is ever passed
    observer = Observer(config, max_passes=config.max_skips if continuous else 0)
    cache = scheduler.block_manager.prefix_cache
    if cache is not None:  # the observer sees which blocks lose their hash to eviction
        evict = cache.evict

        def recording_evict() -> int:
            block_id = evict()
            observer.evicted.add(block_id)
            return block_id

        cache.evict = recording_evict
    aborts = sorted(abort_steps)
    for step_index in range(MAX_STEPS):
        while pending and pending[0][1].arrival_step <= step_index:
            index, spec = pending.pop(0)
            request = _make(f"r{index}", spec)
            requests[request.request_id] = request
            eos_every[request.request_id] = spec.eos_every
            scheduler.add_request(request)
            observer.add(request.request_id)
        if not pending and not scheduler.has_unfinished_requests():
            return requests, observer
        busy = scheduler.has_unfinished_requests()
        cache = scheduler.block_manager.prefix_cache
        observer.hashed_before = set(cache._hash_by_block) if cache is not None else set()
        observer.evicted = set()
        output = scheduler.schedule()
        assert output.scheduled or not busy, "unfinished requests but nothing scheduled"
        observer.check_step(scheduler, output)
        if continuous:
            observer.check_continuous(output)
        while aborts and aborts[0] <= step_index:
            aborts.pop(0)
            _abort_one(scheduler, requests, observer, step_index)
        sampled = {s.request_id: _fake_token(requests[s.request_id], eos_every[s.request_id])
                   for s in output.scheduled if s.sample}
        for request in scheduler.update(output, sampled):
            if request.is_finished:
                observer.forget(request.request_id)
        scheduler.block_manager.check_integrity()
    raise AssertionError(f"not finished after {MAX_STEPS} steps: livelock or starvation")


def _make(request_id: str, spec: Spec) -> Request:
    params = SamplingParams(max_tokens=spec.max_tokens, min_tokens=spec.min_tokens)
    prompt = [1 + i % 50 if i < spec.diverge_at else 60 + (7 * i + spec.family) % 40
              for i in range(spec.num_prompt_tokens)]
    return Request(request_id, prompt, params, eos_token_id=EOS, cache_salt=spec.cache_salt)


def _fake_token(request: Request, eos_every: int) -> int:
    n = request.num_output_tokens + 1
    return EOS if eos_every and n % eos_every == 0 else 100 + n


def _abort_one(scheduler, requests, observer, step_index) -> None:
    """Abort an unfinished request between schedule() and update(), as a client disconnect does."""
    unfinished = [r for r in requests.values() if not r.is_finished]
    if unfinished:
        victim = unfinished[step_index % len(unfinished)]
        assert scheduler.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
        observer.forget(victim.request_id)


def check_end(scheduler, requests: dict[str, Request]) -> None:
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_running == 0 and scheduler.num_waiting == 0
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_total_blocks
    scheduler.block_manager.check_integrity()
    for request in requests.values():
        assert request.is_finished
        if request.status == RequestStatus.FINISHED_LENGTH:
            assert request.num_output_tokens == request.max_output_tokens
        elif request.status == RequestStatus.FINISHED_STOPPED:
            assert request.output_token_ids[-1] == EOS
            assert request.num_output_tokens >= request.sampling_params.min_tokens
        else:
            assert request.status == RequestStatus.FINISHED_ABORTED
        assert EOS not in request.output_token_ids[max(request.sampling_params.min_tokens - 1, 0):-1]


@st.composite
def scenarios(draw, tiny_pool: bool = False, uniform: bool = False):
    config, num_blocks = draw(configs(tiny_pool=tiny_pool))
    specs = draw(workloads(config.max_model_len, uniform=uniform))
    abort_steps = [] if uniform else draw(st.lists(st.integers(0, 60), max_size=3))
    return config, num_blocks, specs, abort_steps


@SETTINGS
@given(scenarios())
def test_continuous_invariants(scenario):
    config, num_blocks, specs, abort_steps = scenario
    scheduler = Scheduler(config, num_blocks, clock=lambda: 0.0)
    requests, _ = drive(scheduler, config, specs, abort_steps, continuous=True)
    check_end(scheduler, requests)


@SETTINGS
@given(scenarios(tiny_pool=True))
def test_continuous_invariants_under_preemption(scenario):
    config, num_blocks, specs, abort_steps = scenario
    scheduler = Scheduler(config, num_blocks, clock=lambda: 0.0)
    requests, _ = drive(scheduler, config, specs, abort_steps, continuous=True)
    check_end(scheduler, requests)


@SETTINGS
@given(scenarios(uniform=True))
def test_equal_requests_are_first_scheduled_in_arrival_order(scenario):
    config, num_blocks, specs, _ = scenario
    scheduler = Scheduler(config, num_blocks, clock=lambda: 0.0)
    requests, observer = drive(scheduler, config, specs, [], continuous=True)
    check_end(scheduler, requests)
    assert observer.first_scheduled == observer.added


@SETTINGS
@given(scenarios())
def test_static_invariants(scenario):
    config, num_blocks, specs, abort_steps = scenario
    scheduler = StaticScheduler(config, num_blocks, clock=lambda: 0.0)
    requests, _ = drive(scheduler, config, specs, abort_steps, continuous=False)
    check_end(scheduler, requests)
