"""Prefix caching with exact block ids: hash chain, sharing, LRU eviction, salts, scheduler."""

import pytest

from carpool.core.block_manager import BlockManager
from carpool.core.config import SchedulerConfig
from carpool.core.prefix_cache import hash_block_tokens
from carpool.core.request import Request, RequestStatus
from carpool.core.scheduler import Scheduler
from carpool.sampling_params import SamplingParams
from tests.core.stepping import FakeClock, plan, step


def request(request_id, prompt, cache_salt=None, max_tokens=4):
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens),
                   cache_salt=cache_salt)


def computed(bm, req, num_tokens):
    """Allocate for `num_tokens` and mark them computed, as a step does."""
    bm.allocate(req.request_id, num_tokens)
    bm.cache_full_blocks(req, num_tokens)


def test_the_hash_chains_over_the_parent_and_the_salt():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, [1, 2, 3, 4]) and len(h0) == 32
    assert h0 != hash_block_tokens(None, [1, 2, 3, 5])
    assert h0 != hash_block_tokens(None, [1, 2, 3, 4], cache_salt="a")
    assert hash_block_tokens(None, [1], "a") != hash_block_tokens(None, [1], "b")
    assert hash_block_tokens(h0, [5]) != hash_block_tokens(hash_block_tokens(None, [9]), [5])


def test_a_second_request_shares_the_computed_full_blocks():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = request("a", range(10))
    computed(bm, a, 10)  # blocks 0, 1 full, block 2 partial (never hashed)
    b = request("b", list(range(9)) + [99])
    cached = bm.find_cached_blocks(b)
    assert cached == [0, 1]
    assert bm.allocate("b", 10, cached) == [0, 1, 3]
    assert bm.num_free_blocks == 4
    bm.check_integrity()
    assert bm.free("a") == 1  # only its partial block 2: 0 and 1 are still held by b
    bm.check_integrity()


def test_the_last_token_is_never_served_from_the_cache():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    computed(bm, request("a", range(8)), 8)  # two full blocks
    assert bm.find_cached_blocks(request("b", range(8))) == [0]  # (8 - 1) // 4 = 1 block
    assert bm.find_cached_blocks(request("c", range(9))) == [0, 1]


def test_different_salts_never_share():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    computed(bm, request("a", range(9), cache_salt="tenant-a"), 9)
    assert bm.find_cached_blocks(request("b", range(9), cache_salt="tenant-b")) == []
    assert bm.find_cached_blocks(request("c", range(9))) == []
    assert bm.find_cached_blocks(request("d", range(9), cache_salt="tenant-a")) == [0, 1]


def test_freed_cached_blocks_stay_findable_and_evict_lru_tail_first():
    bm = BlockManager(num_blocks=5, block_size=2, enable_prefix_caching=True)
    a = request("a", range(7))
    computed(bm, a, 7)  # [0, 1, 2, 3]: 0..2 full and hashed, 3 partial
    bm.free("a")
    assert bm.num_free_blocks == 5
    bm.check_integrity()
    assert bm.find_cached_blocks(request("again", range(7))) == [0, 1, 2]
    # New blocks: the plain free queue first (4, then 3), then evict a's tail before its head.
    assert bm.allocate("x", 6) == [4, 3, 2]
    assert bm.find_cached_blocks(request("again2", range(7))) == [0, 1]
    assert bm.allocate("y", 2) == [1]
    assert bm.find_cached_blocks(request("again3", range(7))) == [0]
    bm.check_integrity()


def test_a_hit_takes_a_free_cached_block_out_of_the_lru():
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    computed(bm, request("a", range(5)), 5)  # [0, 1, 2], 0 and 1 hashed
    bm.free("a")
    b = request("b", range(5))
    cached = bm.find_cached_blocks(b)
    assert cached == [0, 1]
    assert bm.can_allocate("b", 5, cached)
    assert not bm.can_allocate("b", 7, cached)  # the hit blocks are not free for new ones
    assert bm.allocate("b", 5, cached) == [0, 1, 2]
    assert bm.num_free_blocks == 0
    bm.check_integrity()


def test_a_duplicate_block_keeps_the_first_hash_and_frees_plainly():
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    a, b = request("a", range(5)), request("b", range(5))
    bm.allocate("a", 5)
    bm.allocate("b", 5)  # both missed, computing the same blocks side by side
    bm.cache_full_blocks(a, 4)
    bm.cache_full_blocks(b, 4)
    assert bm.find_cached_blocks(request("c", range(5))) == [0, 1]
    bm.free("b")
    assert list(bm._free_block_ids) == [3, 4, 5]  # b's blocks had no hash of their own
    bm.check_integrity()


def test_reset_forgets_every_hash():
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    computed(bm, request("a", range(5)), 5)  # [0, 1, 2]
    computed(bm, request("b", [9, 9, 9]), 3)  # [3, 4], 3 hashed and still held
    bm.free("a")
    assert bm.reset_prefix_cache() == 2
    assert bm.find_cached_blocks(request("c", range(5))) == []
    assert bm.find_cached_blocks(request("d", [9, 9, 9])) == []
    assert list(bm._free_block_ids) == [5, 2, 1, 0]
    bm.check_integrity()


@pytest.mark.parametrize("corrupt, message", [
    (lambda bm: bm.prefix_cache._hash_by_block.pop(0), "differ in size"),
    (lambda bm: bm.prefix_cache._evictable.popitem(), "not evictable|neither"),
    (lambda bm: bm._free_block_ids.append(next(iter(bm.prefix_cache._evictable))),
     "plain free queue has a hash"),
    (lambda bm: bm.prefix_cache._evictable.__setitem__(3, None), "has ref count 1|no hash"),
])
def test_check_integrity_covers_hashes(corrupt, message):
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    computed(bm, request("a", range(5)), 5)
    bm.free("a")
    computed(bm, request("b", [7, 7, 7, 7, 7]), 5)
    bm.check_integrity()
    corrupt(bm)
    with pytest.raises(AssertionError, match=message):
        bm.check_integrity()


# -- the scheduler ----------------------------------------------------------------------------

def make_scheduler(num_blocks=32, **overrides):
    fields = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=4)
    fields.update(overrides)
    return Scheduler(SchedulerConfig(**fields), num_blocks=num_blocks, clock=FakeClock())


def test_cached_tokens_count_as_computed_and_cost_no_budget():
    scheduler = make_scheduler()
    scheduler.add_request(request("a", range(14)))
    out = step(scheduler)
    assert plan(out) == [("a", 14)]
    scheduler.add_request(request("b", list(range(13)) + [77]))
    out = step(scheduler)
    assert plan(out) == [("a", 1), ("b", 2)]  # 12 cached tokens, only 2 computed
    scheduled = out.scheduled[1]
    assert scheduled.num_computed_tokens == 12
    assert list(scheduled.block_ids[:3]) == list(out.scheduled[0].block_ids[:3])
    b = scheduler.get_request("b")
    assert b.num_cached_tokens == 12 and b.num_output_tokens == 1
    stats = scheduler.prefix_cache_stats
    assert (stats.num_queries, stats.num_hits) == (14 + 14, 12)


def test_a_request_hits_another_still_prefilling_in_chunks():
    scheduler = make_scheduler(max_num_batched_tokens=12, long_prefill_token_threshold=8,
                               max_num_partial_prefills=2, max_long_partial_prefills=2)
    scheduler.add_request(request("a", range(20)))
    assert plan(step(scheduler)) == [("a", 8)]  # blocks 0, 1 computed and hashed
    scheduler.add_request(request("b", list(range(8)) + [77] * 12))  # diverges at block 2
    out = step(scheduler)
    assert plan(out) == [("a", 8), ("b", 4)]
    assert out.scheduled[1].num_computed_tokens == 8
    assert list(out.scheduled[1].block_ids[:2]) == list(out.scheduled[0].block_ids[:2])
    assert scheduler.get_request("b").num_cached_tokens == 8


def test_a_request_hits_the_blocks_another_computes_in_the_same_step():
    scheduler = make_scheduler(max_num_batched_tokens=12, long_prefill_token_threshold=8,
                               max_num_partial_prefills=2, max_long_partial_prefills=2)
    scheduler.add_request(request("a", range(20)))
    scheduler.add_request(request("b", list(range(8)) + [77] * 12))  # diverges at block 2
    out = step(scheduler)  # a's first chunk fills blocks 0 and 1; b shares them at once
    assert plan(out) == [("a", 8), ("b", 4)]
    assert out.scheduled[1].num_computed_tokens == 8
    assert list(out.scheduled[1].block_ids[:2]) == list(out.scheduled[0].block_ids[:2])
    assert scheduler.get_request("b").num_cached_tokens == 8
    assert scheduler.block_manager._ref_counts[out.scheduled[0].block_ids[0]] == 2


def test_a_failed_step_forgets_the_hashes_it_was_planned_to_fill():
    scheduler = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=16,
                               max_num_partial_prefills=2, max_long_partial_prefills=2)
    scheduler.add_request(request("a", range(20)))
    scheduler.add_request(request("b", range(20)))
    out = scheduler.schedule()  # b's lookup hashes a's blocks 0..3, planned, never computed
    assert plan(out) == [("a", 16), ("b", 4)]  # b hit them
    assert scheduler.block_manager.prefix_cache.num_cached_blocks == 4
    scheduler.reset_prefix_cache()  # what LLMEngine._fail_step does, then it fails them
    scheduler.finish_requests(["a", "b"], RequestStatus.FINISHED_ERROR)
    scheduler.add_request(request("c", range(20)))
    assert scheduler.block_manager.find_cached_blocks(scheduler.get_request("c")) == []


def test_blocks_filled_since_the_last_lookup_are_hashed_when_their_request_ends():
    scheduler = make_scheduler()
    scheduler.add_request(request("a", range(10), max_tokens=7))
    while scheduler.has_unfinished_requests():  # no lookup after a's admission: nothing
        step(scheduler)  # asks for a hash until a ends
        if scheduler.has_unfinished_requests():
            assert scheduler.block_manager.prefix_cache.num_cached_blocks == 0
    # a ends with 17 tokens, 16 computed: its 4 full blocks stay cached, whole
    assert scheduler.block_manager.prefix_cache.num_cached_blocks == 4
    scheduler.add_request(request("b", list(range(10)) + [7] * 6 + [5]))
    assert len(scheduler.block_manager.find_cached_blocks(scheduler.get_request("b"))) == 4


def test_a_request_waits_for_the_prefix_block_another_is_computing():
    scheduler = make_scheduler(max_num_batched_tokens=12, long_prefill_token_threshold=8,
                               max_num_partial_prefills=2, max_long_partial_prefills=2)
    scheduler.add_request(request("a", range(20)))
    assert plan(step(scheduler)) == [("a", 8)]
    scheduler.add_request(request("b", range(21)))
    # This step a fills blocks 2 and 3 (b could share them) but its block 4 only in the next:
    # b waits rather than compute block 4 a second time.
    assert plan(step(scheduler)) == [("a", 8)]
    out = step(scheduler)  # a fills block 4: b hits all 5 of a's blocks in this very step
    assert plan(out) == [("a", 4), ("b", 1)]
    assert list(out.scheduled[1].block_ids[:5]) == list(out.scheduled[0].block_ids)
    assert scheduler.get_request("b").num_cached_tokens == 20
    stats = scheduler.prefix_cache_stats
    assert (stats.num_queries, stats.num_hits) == (41, 20)


def test_the_long_prefill_limit_counts_only_uncached_tokens():
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8,
                               max_num_partial_prefills=2, max_long_partial_prefills=1)
    scheduler.add_request(request("a", range(40), max_tokens=1))
    for _ in range(5):
        step(scheduler)
    assert scheduler.get_request("a") is None  # finished, its 10 blocks cached
    scheduler.add_request(request("long", list(range(30)) + [90] * 10))
    scheduler.add_request(request("b", list(range(36)) + [91] * 4))
    out = step(scheduler)
    # long: 28 cached, 12 to compute (long, chunked to 8); b: 36 cached, 4 left (short, whole)
    assert plan(out) == [("long", 8), ("b", 4)]


def test_preemption_re_hits_its_blocks_but_counts_no_new_hit():
    scheduler = make_scheduler(num_blocks=9, max_num_batched_tokens=32)
    scheduler.add_request(request("a", range(9), max_tokens=12))
    scheduler.add_request(request("b", range(100, 109), max_tokens=20))
    step(scheduler)
    while not scheduler.num_preemptions_total:
        step(scheduler)
    queries, hits = scheduler.prefix_cache_stats.num_queries, scheduler.prefix_cache_stats.num_hits
    victim = scheduler.get_request("b")
    assert victim.status == RequestStatus.PREEMPTED
    while victim.status != RequestStatus.RUNNING:
        out = step(scheduler)
    scheduled = next(s for s in out.scheduled if s.request_id == "b")
    assert scheduled.num_computed_tokens > 0  # re-hit its own computed blocks
    assert (scheduler.prefix_cache_stats.num_queries,
            scheduler.prefix_cache_stats.num_hits) == (queries, hits)
    assert victim.num_cached_tokens == 0
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert scheduler.block_manager.num_free_blocks == 9


def test_caching_off_shares_nothing():
    scheduler = make_scheduler(enable_prefix_caching=False)
    scheduler.add_request(request("a", range(14)))
    step(scheduler)
    scheduler.add_request(request("b", range(14)))
    assert plan(step(scheduler)) == [("a", 1), ("b", 14)]
    assert scheduler.block_manager.prefix_cache is None
    assert scheduler.prefix_cache_stats.num_queries == 0
