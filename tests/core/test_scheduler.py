"""The continuous scheduler, step by step, with exact token counts and block ids."""

import pytest

from carpool.core.config import SchedulerConfig
from carpool.core.request import RequestStatus
from carpool.core.scheduler import Scheduler
from tests.core.stepping import FakeClock, make_request, plan, step


def make_scheduler(num_blocks=32, **overrides):
    # Every request here has the same prompt tokens: prefix caching would change the exact
    # schedules asserted, so it is off unless asked for (tests/core/test_prefix_cache.py).
    fields = dict(max_num_seqs=4, max_num_batched_tokens=10, max_model_len=64, block_size=4,
                  enable_prefix_caching=False)
    fields.update(overrides)
    return Scheduler(SchedulerConfig(**fields), num_blocks=num_blocks, clock=FakeClock())


# -- admission checks ------------------------------------------------------------------------

def test_add_request_rejects_what_could_never_run():
    s = make_scheduler(num_blocks=4, max_model_len=20)
    with pytest.raises(ValueError, match=r"20 tokens.*max_model_len \(20\)"):
        s.add_request(make_request("long", 20))
    with pytest.raises(ValueError, match=r"12 prompt \+ 8 max output.*5 blocks.*4 blocks"):
        s.add_request(make_request("big", 12, max_tokens=8))
    s.add_request(make_request("ok", 12, max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("ok", 3))
    assert s.num_waiting == 1 and s.get_request("ok").status == RequestStatus.WAITING


def test_max_tokens_none_is_capped_by_max_model_len():
    s = make_scheduler(max_model_len=8)
    s.add_request(make_request("a", 5, max_tokens=None))
    outputs = [step(s) for _ in range(3)]
    assert plan(outputs[0]) == [("a", 5)]
    assert not s.has_unfinished_requests()
    assert s.block_manager.num_free_blocks == 32


# -- the order of a step ---------------------------------------------------------------------

def test_decodes_first_then_prefill_chunks_then_fcfs_admission():
    s = make_scheduler()
    for rid, n in (("a", 3), ("b", 12), ("c", 2)):
        s.add_request(make_request(rid, n))
    out1 = step(s)
    assert plan(out1) == [("a", 3), ("b", 7)]  # b chunked to the budget; c waits
    assert [x.sample for x in out1.scheduled] == [True, False]
    assert [list(x.block_ids) for x in out1.scheduled] == [[0], [1, 2]]
    assert list(out1.scheduled[1].token_ids) == list(range(100, 107))
    out2 = step(s)
    assert plan(out2) == [("a", 1), ("b", 5), ("c", 2)]
    assert out2.scheduled[1].num_computed_tokens == 7
    # b's table grows: block 3, with 4..18 set aside as its spares (growth runs), so c's
    # new table starts at 19
    assert [list(x.block_ids) for x in out2.scheduled] == [[0], [1, 2, 3], [19]]
    out3 = step(s)
    assert plan(out3) == [("a", 1), ("b", 1), ("c", 1)]
    assert [list(x.block_ids) for x in out3.scheduled] == [[0, 20], [1, 2, 3, 4], [19]]
    assert list(out3.scheduled[0].token_ids) == [7]  # a's first output is fed back


def test_scheduled_request_shares_the_requests_lists():
    s = make_scheduler()
    request = make_request("a", 3)
    s.add_request(request)
    out = s.schedule()
    assert out.scheduled[0].prompt_token_ids is request.prompt_token_ids
    assert out.scheduled[0].output_token_ids is request.output_token_ids


def test_max_num_seqs_and_budget_hold():
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=3)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 1))
    assert plan(step(s)) == [("r0", 1), ("r1", 1)]
    assert s.num_running == 2 and s.num_waiting == 2


def test_without_chunked_prefill_a_prompt_is_admitted_only_whole():
    s = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=16)
    s.add_request(make_request("a", 10))
    s.add_request(make_request("b", 10))
    assert plan(step(s)) == [("a", 10)]
    assert plan(step(s)) == [("a", 1), ("b", 10)]


# -- partial prefill limits ------------------------------------------------------------------

def test_one_long_prompt_does_not_keep_short_ones_out():
    s = make_scheduler(max_num_batched_tokens=20, max_num_seqs=8, max_num_partial_prefills=2,
                       max_long_partial_prefills=1, long_prefill_token_threshold=8)
    for rid, n in (("L1", 30), ("L2", 30), ("s", 5)):
        s.add_request(make_request(rid, n))
    assert plan(step(s)) == [("L1", 8), ("s", 5)]  # L2 would be a second long partial prefill
    assert plan(step(s)) == [("s", 1), ("L1", 8)]
    assert plan(step(s)) == [("s", 1), ("L1", 8)]
    assert plan(step(s)) == [("s", 1), ("L1", 6), ("L2", 8)]  # L1 completes: L2 may start


def test_max_num_partial_prefills_counts_short_partials_too():
    s = make_scheduler(max_num_batched_tokens=6, max_num_partial_prefills=1,
                       max_long_partial_prefills=1)
    for rid in ("a", "b", "c"):
        s.add_request(make_request(rid, 4))
    assert plan(step(s)) == [("a", 4), ("b", 2)]  # b part-way: c may not also be
    assert plan(step(s)) == [("a", 1), ("b", 2), ("c", 3)]  # b completes, c takes the slot


# -- skipping and aging ----------------------------------------------------------------------

@pytest.mark.parametrize("max_skips, step3", [(1, [("a", 1)]), (16, [("a", 1), ("s3", 2)])])
def test_a_big_request_is_skipped_but_ages(max_skips, step3):
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=64, max_skips=max_skips)
    s.add_request(make_request("a", 13, max_tokens=3))
    s.add_request(make_request("big", 9, max_tokens=2))
    for rid in ("s1", "s2", "s3"):
        s.add_request(make_request(rid, 2, max_tokens=2))
    assert plan(step(s)) == [("a", 13), ("s1", 2), ("s2", 2)]  # big does not fit: skipped once
    assert plan(step(s)) == [("a", 1), ("s1", 1), ("s2", 1)]
    assert plan(step(s)) == step3  # aged: nothing passes big any more
    if max_skips == 1:
        out = step(s)
        assert plan(out) == [("big", 9), ("s3", 2)]
        assert [list(x.block_ids) for x in out.scheduled] == [[4, 5, 0], [1]]


# -- preemption ------------------------------------------------------------------------------

def test_preemption_frees_the_newest_and_recomputes_it_with_its_outputs():
    s = make_scheduler(num_blocks=4, max_model_len=32, max_num_batched_tokens=64)
    s.add_request(make_request("a", 4, max_tokens=8))
    s.add_request(make_request("b", 4, max_tokens=8))
    for _ in range(5):  # both grow to 8 tokens: blocks [0, 2] and [1, 3], none free
        step(s)
    assert s.block_manager.get_block_table("b") == [1, 3]
    out = step(s, token_id=9)
    assert out.preempted_ids == ["b"] and plan(out) == [("a", 1)]
    assert list(out.scheduled[0].block_ids) == [0, 2, 1]
    b = s.get_request("b")
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and s.num_preemptions_total == 1
    assert b.output_token_ids == [7] * 5  # kept
    for _ in range(2):
        assert plan(step(s)) == [("a", 1)]  # b needs 3 blocks, 1 is free
    assert s.get_request("a") is None
    out = step(s)
    assert plan(out) == [("b", 9)]
    assert list(out.scheduled[0].token_ids) == [100, 101, 102, 103] + [7] * 5
    assert out.scheduled[0].sample and list(out.scheduled[0].block_ids) == [3, 0, 2]


def test_a_request_that_is_the_newest_preempts_itself():
    s = make_scheduler(num_blocks=4, max_model_len=32, max_num_batched_tokens=64)
    s.add_request(make_request("a", 4, max_tokens=8))
    s.add_request(make_request("b", 5, max_tokens=7))
    for _ in range(4):
        step(s)
    out = step(s)
    assert out.preempted_ids == ["b"] and plan(out) == [("a", 1)]
    assert s.get_request("b").status == RequestStatus.PREEMPTED


@pytest.mark.parametrize("policy, victim", [("newest", "c"), ("least_work", "b")])
def test_preemption_policy_picks_the_victim(policy, victim):
    s = make_scheduler(num_blocks=5, max_num_batched_tokens=64, preemption_policy=policy)
    s.add_request(make_request("a", 8, max_tokens=4))
    s.add_request(make_request("b", 2, max_tokens=4))
    s.add_request(make_request("c", 6, max_tokens=4))
    step(s)
    out = step(s)
    assert out.preempted_ids == [victim]
    assert victim not in [x.request_id for x in out.scheduled]
    assert s.num_waiting == 1


def test_a_scheduled_victim_is_taken_out_of_the_step():
    # b decodes first (scheduled), then a's prefill chunk needs a block: the newest is b.
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=64, long_prefill_token_threshold=4,
                       max_model_len=32)
    s.add_request(make_request("a", 12, max_tokens=2))
    s.add_request(make_request("b", 3, max_tokens=4))
    assert plan(step(s)) == [("a", 4), ("b", 3)]
    assert plan(step(s)) == [("b", 1), ("a", 4)]
    out = step(s)
    assert out.preempted_ids == ["b"] and plan(out) == [("a", 4)]
    assert list(out.scheduled[0].block_ids) == [0, 2, 1]


# -- update: tokens and stopping -------------------------------------------------------------

@pytest.mark.parametrize("sampling, tokens, status, num_outputs, reason", [
    (dict(), [2], RequestStatus.FINISHED_STOPPED, 1, None),
    (dict(min_tokens=2), [2, 2], RequestStatus.FINISHED_STOPPED, 2, None),
    (dict(ignore_eos=True, max_tokens=3), [2, 2, 2], RequestStatus.FINISHED_LENGTH, 3, None),
    (dict(stop_token_ids=(5,)), [4, 5], RequestStatus.FINISHED_STOPPED, 2, 5),
    (dict(max_tokens=3), [4, 4, 4], RequestStatus.FINISHED_LENGTH, 3, None),
])
def test_stop_rules(sampling, tokens, status, num_outputs, reason):
    s = make_scheduler()
    request = make_request("a", 3, **({"max_tokens": 16} | sampling))
    request.eos_token_id = 2
    s.add_request(request)
    for token in tokens:
        out = s.schedule()
        produced = s.update(out, {"a": token})
        assert produced == [request]
    assert request.status == status and request.num_output_tokens == num_outputs
    assert request.stop_reason == reason
    assert s.block_manager.num_free_blocks == 32 and not s.has_unfinished_requests()
    assert s.schedule().finished_ids == ["a"]
    assert s.schedule().finished_ids == []


def test_timestamps_follow_the_clock():
    s = make_scheduler(max_num_batched_tokens=4)
    clock = s._clock
    clock.now = 1.0
    request = make_request("a", 6, max_tokens=2)
    s.add_request(request)
    clock.now = 2.0
    step(s)  # 4 of 6 prompt tokens: nothing sampled
    assert request.queued_time == 1.0 and request.first_scheduled_time == 2.0
    assert request.first_token_time is None
    clock.now = 3.0
    step(s)
    clock.now = 4.0
    step(s)
    assert request.first_token_time == 3.0 and request.finished_time == 4.0


def test_update_twice_with_one_output_is_refused():
    s = make_scheduler()
    s.add_request(make_request("a", 3))
    out = s.schedule()
    s.update(out, {"a": 1})
    with pytest.raises(ValueError, match="stale"):
        s.update(out, {"a": 1})


def test_a_missing_sampled_token_is_an_error():
    s = make_scheduler()
    s.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="no sampled token for 'a'"):
        s.update(s.schedule(), {})


# -- aborts ----------------------------------------------------------------------------------

def test_finish_requests_frees_at_once_and_ignores_unknown_ids():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("run", 5))
    s.add_request(make_request("wait", 5))
    out = s.schedule()
    aborted = s.finish_requests(["run", "wait", "nope"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in aborted] == ["run", "wait"]
    assert all(r.finish_reason == "abort" and r.finished_time is not None for r in aborted)
    assert s.block_manager.num_free_blocks == 32
    assert s.update(out, {"run": 1}) == []  # aborted between schedule and update
    assert s.finish_requests(["run"], RequestStatus.FINISHED_ABORTED) == []
    assert s.schedule().finished_ids == ["run", "wait"]
    assert not s.has_unfinished_requests() and s.num_running == 0 and s.num_waiting == 0


def test_finish_requests_needs_a_finished_status():
    s = make_scheduler()
    with pytest.raises(ValueError, match="finished status"):
        s.finish_requests(["a"], RequestStatus.RUNNING)
