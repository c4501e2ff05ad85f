"""Packed inputs: positions, slots through the block table, logits rows, padding, the layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput
from carpool.runner.input_batch import build_input_batch
from carpool.sampling_params import SamplingParams

CPU = torch.device("cpu")
P = SamplingParams()


def test_packed_positions_slots_and_logits_rows():
    prefill = ScheduledRequest("a", [5, 6, 7], 2, [9, 4], False, P)  # positions 2..4, block 4
    decode = ScheduledRequest("b", [8], 6, [1, 3], True, P)  # position 6 -> block 3 slot 2
    batch = build_input_batch(SchedulerOutput([prefill, decode], num_padding_tokens=2),
                              block_size=4, scratch_block=10, device=CPU)
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 0, 0]
    assert batch.positions.tolist() == [2, 3, 4, 6, 0, 0]
    layout = batch.layout
    assert layout.slot_mapping.tolist() == [9 * 4 + 2, 9 * 4 + 3, 4 * 4 + 0, 3 * 4 + 2, 40, 40]
    assert batch.logits_indices.tolist() == [3]
    assert [r.request_id for r in batch.sampled] == ["b"]
    # The chunk, the decode, then the padding tokens as one-token requests at position 0.
    assert layout.query_starts.tolist() == [0, 3, 4, 5]
    assert layout.query_lens.tolist() == [3, 1, 1, 1]
    assert layout.num_computed.tolist() == [2, 6, 0, 0]
    assert layout.block_table.tolist() == [[9, 4], [1, 3], [10, 0], [10, 0]]  # padded with 0
    assert layout.num_cache_blocks == 11 and layout.num_tokens == 6


def test_causal_mask_per_request():
    from carpool.attention import AttentionShape
    from carpool.attention.paged import build_group

    req = ScheduledRequest("a", [1, 2, 3], 2, [0, 1], True, P)
    batch = build_input_batch(SchedulerOutput([req]), block_size=4, scratch_block=9, device=CPU)
    group = build_group(batch.layout, np.array([0]), AttentionShape(2, 1, 8), CPU)
    mask = group.mask[0, 0]  # (max_q, max_ctx)
    assert mask.sum(dim=-1).tolist() == [3, 4, 5]  # positions 2, 3, 4 see 0..pos


def test_too_few_blocks_is_named():
    req = ScheduledRequest("short", [1] * 5, 0, [0], True, P)
    with pytest.raises(ValueError, match="short"):
        build_input_batch(SchedulerOutput([req]), block_size=4, scratch_block=9, device=CPU)


def test_blocks_beyond_the_step_are_left_out():
    # The static baseline may hold blocks for tokens to come: the table stops at this step's.
    long = ScheduledRequest("long", [5], 4, [7, 8, 9], True, P)  # position 4 -> block 8
    short = ScheduledRequest("short", [6], 0, [3], True, P)
    batch = build_input_batch(SchedulerOutput([long, short]), block_size=4, scratch_block=10,
                              device=CPU)
    assert batch.layout.block_table.tolist() == [[7, 8], [3, 0]]
    assert batch.layout.slot_mapping.tolist() == [8 * 4, 3 * 4]


def test_no_tokens_is_named():
    req = ScheduledRequest("idle", [], 0, [0], True, P)
    with pytest.raises(ValueError, match="idle"):
        build_input_batch(SchedulerOutput([req]), block_size=4, scratch_block=9, device=CPU)
