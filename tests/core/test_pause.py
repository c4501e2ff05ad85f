"""Flow control in the scheduler: a paused request (its client stopped reading) is never
scheduled, gives up its seat, keeps its blocks until someone needs them, and finishes like
any other once resumed."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from carpool.core.config import SchedulerConfig
from carpool.core.request import RequestStatus
from carpool.core.scheduler import Scheduler
from tests.core.stepping import make_request, step
from tests.core.test_properties import SETTINGS, _fake_token, _make, check_end, scenarios


def _ids(output) -> set[str]:
    return {s.request_id for s in output.scheduled}


def test_a_paused_request_gives_its_seat_to_a_waiting_one_and_keeps_its_blocks():
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                             block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(config, num_blocks=64)
    for rid in ("a", "b", "c"):
        scheduler.add_request(make_request(rid, 6, max_tokens=8))
    assert _ids(step(scheduler)) == {"a", "b"}  # c waits: two seats
    blocks_of_a = scheduler.block_manager.get_block_table("a")
    scheduler.pause_requests(["a"])
    assert scheduler.num_paused == 1
    assert _ids(step(scheduler)) == {"b", "c"}  # a's seat went to c
    for _ in range(3):
        assert "a" not in _ids(step(scheduler))
    assert scheduler.block_manager.get_block_table("a") == blocks_of_a
    assert scheduler.get_request("a").num_output_tokens == 1

    scheduler.resume_requests(["a"])
    assert _ids(step(scheduler)) == {"a", "b"}  # a, older, takes a seat back; c waits
    while scheduler.has_unfinished_requests():
        output = step(scheduler)
        assert len(output.scheduled) <= 2
    assert scheduler.num_paused == 0
    assert scheduler.block_manager.num_free_blocks == 64


def test_a_paused_request_is_the_first_to_give_up_its_blocks():
    # 6 blocks of 4: a (paused) holds 2, b grows until it needs a's
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=24,
                             block_size=4, preemption_policy="newest",
                             enable_prefix_caching=False)
    scheduler = Scheduler(config, num_blocks=6)
    scheduler.add_request(make_request("a", 6, max_tokens=4))
    scheduler.add_request(make_request("b", 8, max_tokens=16))
    step(scheduler)
    scheduler.pause_requests(["a"])
    preempted = []
    while scheduler.get_request("b") is not None:
        preempted += step(scheduler).preempted_ids
    assert preempted == ["a"]  # not b, the newest, which the policy alone would pick
    request_a = scheduler.get_request("a")
    assert request_a.status == RequestStatus.PREEMPTED and request_a.num_computed_tokens == 0
    for _ in range(3):
        assert "a" not in _ids(step(scheduler))  # still paused in the queue
    scheduler.resume_requests(["a"])
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert request_a.status == RequestStatus.FINISHED_LENGTH
    assert request_a.num_output_tokens == 4


def test_a_resumed_request_without_a_seat_is_preempted_before_a_seated_one():
    # One seat, 4 blocks of 2. a runs, is paused; b takes the seat and all free blocks; a is
    # resumed and takes the seat back (older), b keeps its blocks unseated. When a needs a
    # block, least_work would pick a itself (fewer computed tokens): the step would preempt a
    # and schedule nothing. b, which cannot run this step anyway, gives up its blocks instead.
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=16,
                             block_size=2, preemption_policy="least_work",
                             enable_prefix_caching=False)
    scheduler = Scheduler(config, num_blocks=4)
    scheduler.add_request(make_request("a", 1, max_tokens=4))
    assert _ids(step(scheduler)) == {"a"}  # a: 1 block
    scheduler.pause_requests(["a"])
    scheduler.add_request(make_request("b", 5, max_tokens=2))
    assert _ids(step(scheduler)) == {"b"}  # b: 3 blocks, none free
    scheduler.resume_requests(["a"])
    assert _ids(step(scheduler)) == {"a"}  # a's 2nd token still fits its block; b unseated
    output = step(scheduler)  # a needs a 2nd block
    assert (_ids(output), output.preempted_ids) == ({"a"}, ["b"])
    while scheduler.has_unfinished_requests():
        assert step(scheduler).scheduled
    assert scheduler.block_manager.num_free_blocks == 4


def test_aborting_a_paused_request_frees_it():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64,
                                          max_model_len=64, block_size=4,
                                          enable_prefix_caching=False), num_blocks=16)
    scheduler.add_request(make_request("a", 6))
    step(scheduler)
    scheduler.pause_requests(["a", "unknown"])
    assert scheduler.num_paused == 1
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.num_paused == 0 and not scheduler.has_unfinished_requests()
    assert scheduler.block_manager.num_free_blocks == 16


@SETTINGS
@given(scenarios(tiny_pool=True), st.lists(st.tuples(st.integers(0, 80), st.integers(1, 30),
                                                     st.integers(0, 1000)), max_size=6))
def test_pausing_at_random_keeps_every_invariant(scenario, pauses):
    """Requests paused for random spans of steps (chunked prefill, preemption, prefix caching
    drawn at random): no paused request is scheduled, the unpaused running ones never exceed
    max_num_seqs, blocks stay intact, and everything finishes with every block free."""
    config, num_blocks, specs, _ = scenario
    scheduler = Scheduler(config, num_blocks, clock=lambda: 0.0)
    requests = {}
    pending = sorted(enumerate(specs), key=lambda item: item[1].arrival_step)
    resume_at: dict[str, int] = {}
    for step_index in range(20_000):
        while pending and pending[0][1].arrival_step <= step_index:
            index, spec = pending.pop(0)
            request = _make(f"r{index}", spec)
            requests[request.request_id] = (request, spec.eos_every)
            scheduler.add_request(request)
        for start, length, pick in pauses:
            unfinished = sorted(rid for rid, (r, _) in requests.items() if not r.is_finished)
            if start == step_index and unfinished:
                rid = unfinished[pick % len(unfinished)]
                scheduler.pause_requests([rid])
                resume_at[rid] = step_index + length
        for rid in [rid for rid, at in resume_at.items() if at <= step_index]:
            scheduler.resume_requests([rid])
            del resume_at[rid]
        if not pending and not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        scheduled = _ids(output)
        assert not scheduled & set(resume_at), "a paused request was scheduled"
        assert len(output.scheduled) <= config.max_num_seqs
        assert output.scheduled or resume_at or not scheduler.has_unfinished_requests()
        scheduler.block_manager.check_integrity()
        sampled = {s.request_id: _fake_token(requests[s.request_id][0],
                                             requests[s.request_id][1])
                   for s in output.scheduled if s.sample}
        scheduler.update(output, sampled)
        scheduler.block_manager.check_integrity()
    else:
        raise AssertionError("not finished: livelock")
    check_end(scheduler, {rid: r for rid, (r, _) in requests.items()})
    assert scheduler.num_paused == 0
