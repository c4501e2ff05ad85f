"""Block accounting with exact ids: allocate, grow, free, reuse order, integrity."""

import pytest

from carpool.core.block_manager import BlockManager, NoFreeBlocksError


def test_allocate_takes_blocks_from_the_front_in_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 5) == [0, 1]
    assert bm.allocate("b", 4) == [2]
    assert bm.allocate("c", 1) == [3]
    assert bm.num_free_blocks == 4
    assert bm.usage == pytest.approx(0.5)
    bm.check_integrity()


def test_append_grows_only_when_the_last_block_is_full():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 5)
    bm.allocate("b", 2)
    assert bm.allocate("a", 8) == [0, 1]  # still fits in block 1
    assert bm.allocate("a", 9) == [0, 1, 3]  # block 2 went to b
    assert bm.allocate("a", 3) == [0, 1, 3]  # never shrinks
    assert bm.get_block_table("a") == [0, 1, 3]
    bm.check_integrity()


def test_free_returns_blocks_to_the_back_of_the_queue_in_table_order():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate("a", 4)  # [0, 1]
    bm.allocate("b", 4)  # [2, 3]
    assert bm.free("a") == 2
    assert bm.get_block_table("a") == []
    assert bm.allocate("c", 6) == [4, 5, 0]
    assert bm.allocate("d", 2) == [1]
    assert bm.free("b") == 2 and bm.free("b") == 0
    assert bm.allocate("c", 10) == [4, 5, 0, 2, 3]
    bm.check_integrity()


def test_preemption_frees_everything_and_recompute_gets_new_ids():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("old", 8)  # [0, 1]
    bm.allocate("new", 8)  # [2, 3]
    assert not bm.can_allocate("old", 9)
    bm.free("new")  # "new" is preempted
    assert bm.allocate("old", 9) == [0, 1, 2]
    assert bm.allocate("new", 4) == [3]  # recompute starts over
    bm.check_integrity()


def test_a_short_pool_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", 8)
    with pytest.raises(NoFreeBlocksError, match="needs 2 more blocks"):
        bm.allocate("b", 5)
    assert bm.num_free_blocks == 1 and not bm.holds("b")
    assert bm.num_new_blocks_needed("a", 13) == 2
    bm.check_integrity()


def test_internal_waste_is_the_slack_in_last_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 5)  # 3 slots spare
    bm.allocate("b", 8)  # none
    assert bm.num_wasted_slots == 3
    bm.allocate("a", 7)
    assert bm.num_wasted_slots == 1


@pytest.mark.parametrize("corrupt, message", [
    (lambda bm: bm._free_block_ids.append(0), "twice|both free and held"),
    (lambda bm: bm._free_block_ids.popleft(), "neither"),
    (lambda bm: bm._tables["a"].append(3), "blocks for|ref count"),
    (lambda bm: bm._ref_counts.__setitem__(1, 2), "ref count"),
])
def test_check_integrity_catches_corruption(corrupt, message):
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.allocate("a", 8)
    bm.check_integrity()
    corrupt(bm)
    with pytest.raises(AssertionError, match=message):
        bm.check_integrity()


@pytest.mark.parametrize("field, kwargs", [("num_blocks", dict(num_blocks=0, block_size=4)),
                                           ("block_size", dict(num_blocks=4, block_size=0)),
                                           ("num_blocks", dict(num_blocks=True, block_size=4))])
def test_bad_sizes_raise_naming_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        BlockManager(**kwargs)


# -- growth runs -----------------------------------------------------------------------------

def test_tables_growing_together_get_runs_of_consecutive_ids():
    bm = BlockManager(num_blocks=32, block_size=2, growth_run_blocks=4)
    bm.allocate("a", 2)  # [0]
    bm.allocate("b", 2)  # [1]
    for tokens in range(4, 11, 2):  # both decode, a block at a time, in turn
        bm.allocate("a", tokens)
        bm.allocate("b", tokens)
    assert bm.get_block_table("a") == [0, 2, 3, 4, 5]
    assert bm.get_block_table("b") == [1, 6, 7, 8, 9]
    assert bm.num_free_blocks == 32 - 10  # spares are free
    bm.check_integrity()


def test_a_run_of_one_interleaves_growing_tables():
    bm = BlockManager(num_blocks=16, block_size=2, growth_run_blocks=1)
    bm.allocate("a", 2)
    bm.allocate("b", 2)
    for tokens in (4, 6):
        bm.allocate("a", tokens)
        bm.allocate("b", tokens)
    assert bm.get_block_table("a") == [0, 2, 4]
    assert bm.get_block_table("b") == [1, 3, 5]


def test_spares_return_to_the_queue_after_their_table():
    bm = BlockManager(num_blocks=8, block_size=2, growth_run_blocks=4)
    bm.allocate("a", 2)  # [0]
    bm.allocate("a", 3)  # [0, 1], spares 2, 3, 4
    bm.allocate("b", 2)  # [5]
    assert bm.free("a") == 2
    assert list(bm._free_block_ids) == [6, 7, 0, 1, 2, 3, 4]
    bm.check_integrity()


def test_an_empty_queue_lends_spares_before_evicting_cached_blocks():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True,
                      growth_run_blocks=8)
    bm.allocate("a", 2)  # [0]
    bm.allocate("a", 3)  # [0, 1], spares 2..7: the queue is empty
    assert bm.num_free_blocks == 6 and bm.can_allocate("b", 12)
    assert bm.allocate("b", 6) == [7, 6, 5]  # a's spares, from the far end
    assert bm.allocate("a", 5) == [0, 1, 2]  # a still grows into its nearest spare
    assert bm.allocate("b", 10) == [7, 6, 5, 4, 3]
    assert bm.num_free_blocks == 0 and not bm.can_allocate("b", 11)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("a", 7)
    bm.check_integrity()


def test_a_growing_table_with_no_spares_takes_what_is_free():
    bm = BlockManager(num_blocks=4, block_size=2, growth_run_blocks=4)
    bm.allocate("a", 2)  # [0]
    bm.allocate("b", 2)  # [1]
    bm.allocate("a", 3)  # [0, 2], spare 3
    assert bm.allocate("b", 3) == [1, 3]  # b grows into a's spare: the queue is empty
    assert bm.num_free_blocks == 0
    bm.check_integrity()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_growth_run_blocks_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="growth_run_blocks"):
        BlockManager(num_blocks=4, block_size=2, growth_run_blocks=bad)


def test_check_integrity_catches_a_spare_that_is_also_held():
    bm = BlockManager(num_blocks=8, block_size=2, growth_run_blocks=4)
    bm.allocate("a", 2)
    bm.allocate("a", 3)  # [0, 1], spares 2, 3, 4
    bm._tables["a"].append(2)
    bm._num_tokens["a"] = 6
    bm._ref_counts[2] = 1
    with pytest.raises(AssertionError, match="both free and held"):
        bm.check_integrity()
