"""The static baseline: whole-batch prefill, seats held until the batch ends, padding counted."""

import pytest

from carpool.core.config import SchedulerConfig
from carpool.core.request import RequestStatus
from carpool.core.static_scheduler import StaticScheduler
from tests.core.stepping import FakeClock, make_request, plan, step


def make_static(num_blocks=40, **overrides):
    fields = dict(max_num_seqs=3, max_num_batched_tokens=8, max_model_len=64, block_size=4,
                  scheduler="static")
    fields.update(overrides)
    return StaticScheduler(SchedulerConfig(**fields), num_blocks=num_blocks, clock=FakeClock())


def test_a_batch_prefills_whole_then_decodes_until_every_member_ends():
    s = make_static()
    for rid, prompt, max_tokens in (("a", 10, 3), ("b", 4, 1), ("c", 7, 2), ("d", 2, 1)):
        s.add_request(make_request(rid, prompt, max_tokens=max_tokens))
    out = step(s)
    assert plan(out) == [("a", 10), ("b", 4), ("c", 7)]  # over the 8-token budget, like HF
    assert out.num_padding_tokens == (10 - 4) + (10 - 7)
    assert [list(x.block_ids) for x in out.scheduled] == [[0, 1, 2], [3], [4, 5]]
    assert all(x.sample for x in out.scheduled)
    assert s.get_request("b") is None  # ended at once, blocks freed...
    assert s.block_manager.num_free_blocks == 40 - 5
    out = step(s)
    assert plan(out) == [("a", 1), ("c", 1)]
    assert out.num_padding_tokens == 1  # ...but b's seat is still computed
    assert out.finished_ids == ["b"]
    assert s.num_running == 1 and s.num_waiting == 1 and s.seated_request_ids == ["a", "b", "c"]
    out = step(s)
    assert plan(out) == [("a", 1)] and out.num_padding_tokens == 2
    out = step(s)
    assert plan(out) == [("d", 2)] and out.num_padding_tokens == 0  # next batch
    assert out.finished_ids == ["a"]
    assert not s.has_unfinished_requests() and s.block_manager.num_free_blocks == 40


def test_outputs_are_cut_at_each_members_own_end():
    s = make_static()
    a = make_request("a", 3, max_tokens=5)
    b = make_request("b", 3, max_tokens=5)
    b.eos_token_id = 9
    s.add_request(a)
    s.add_request(b)
    s.update(s.schedule(), {"a": 1, "b": 9})
    assert b.status == RequestStatus.FINISHED_STOPPED and b.output_token_ids == [9]
    while s.has_unfinished_requests():
        step(s, token_id=1)
    assert a.output_token_ids == [1] * 5 and b.output_token_ids == [9]


def test_a_batch_is_seated_only_as_far_as_the_pool_holds_every_member_whole():
    s = make_static(num_blocks=5)
    s.add_request(make_request("a", 4, max_tokens=8))  # 3 blocks at most
    s.add_request(make_request("b", 4, max_tokens=8))  # 3 more would not fit
    s.add_request(make_request("c", 2, max_tokens=2))  # FCFS: waits behind b
    assert plan(step(s)) == [("a", 4)]  # c does not jump the queue
    while s.get_request("a") is not None:
        step(s)
    assert plan(step(s)) == [("b", 4), ("c", 2)]


def test_aborting_a_member_frees_its_blocks_but_not_its_seat():
    s = make_static()
    s.add_request(make_request("a", 4, max_tokens=4))
    s.add_request(make_request("b", 4, max_tokens=4))
    s.add_request(make_request("c", 4, max_tokens=4))
    s.add_request(make_request("w", 4, max_tokens=4))
    step(s)
    assert [r.request_id for r in s.finish_requests(["b", "w"], RequestStatus.FINISHED_ABORTED)] \
        == ["b", "w"]
    out = step(s)
    assert plan(out) == [("a", 1), ("c", 1)] and out.num_padding_tokens == 1
    assert s.block_manager.get_block_table("b") == [] and s.num_waiting == 0
    while s.has_unfinished_requests():
        step(s)
    assert s.block_manager.num_free_blocks == 40


def test_static_rejects_like_continuous():
    s = make_static(num_blocks=2, max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(make_request("a", 16))
    with pytest.raises(ValueError, match="blocks"):
        s.add_request(make_request("b", 8, max_tokens=4))
