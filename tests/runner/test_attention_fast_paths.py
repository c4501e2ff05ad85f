"""The CPU fast paths of paged attention give the per-request reference answer.

Decodes are split into groups of similar context length, and prompts prefilled
from position 0 take a per-prompt causal path; both must change only the cost,
never the result.
"""

from __future__ import annotations

import random

import torch
from test_attention import BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, assert_matches_reference

from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput
from carpool.runner.attention import paged_attention, write_kv
from carpool.runner.input_batch import MIN_ROWS_PER_DECODE_GROUP, build_input_batch
from carpool.sampling_params import SamplingParams

NUM_DECODES = 40
CPU = torch.device("cpu")


def _batch(shapes, window=None, seed=0):
    """Requests of (num_computed, num_new) with random past K/V already in a fresh cache."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // BLOCK_SIZE) for c, n in shapes)
    cache = torch.zeros(2, KV_HEADS, num_blocks + 1, BLOCK_SIZE, HEAD_DIM)  # head-major
    free = list(range(num_blocks))
    rng.shuffle(free)
    requests, history = [], []
    for i, (num_computed, num_new) in enumerate(shapes):
        blocks = [free.pop() for _ in range(-(-(num_computed + num_new) // BLOCK_SIZE))]
        past = torch.randn(2, num_computed, KV_HEADS, HEAD_DIM, generator=gen)
        for pos in range(num_computed):
            cache[:, :, blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = past[:, pos]
        requests.append(ScheduledRequest(f"r{i}", [1] * num_new, num_computed, blocks, True,
                                         SamplingParams()))
        history.append(past)
    batch = build_input_batch(SchedulerOutput(requests), block_size=BLOCK_SIZE,
                              scratch_block=num_blocks, device=CPU, sliding_window=window)
    return cache, requests, history, batch


def _shapes(seed=0):
    rng = random.Random(seed)
    decodes = [(rng.randint(1, 60), 1) for _ in range(NUM_DECODES)]
    return decodes[:20] + [(0, 9), (0, 3)] + decodes[20:] + [(11, 5)]  # fresh, fresh, later chunk


def test_decodes_are_grouped_by_context_length_and_each_appears_once():
    _, requests, _, batch = _batch(_shapes())
    lengths = {i: r.num_computed_tokens + 1 for i, r in enumerate(requests)}
    packed = [0]
    for r in requests:
        packed.append(packed[-1] + len(r.token_ids))
    decode_tokens = {packed[i] for i, r in enumerate(requests) if len(r.token_ids) == 1}
    decode_groups = [g for g in batch.meta.groups if g.query_index.shape[1] == 1]
    assert len(decode_groups) > 1
    seen = [t for g in decode_groups for t in g.valid_tokens.tolist()]
    assert sorted(seen) == sorted(decode_tokens)
    index_of = {packed[i]: i for i in range(len(requests))}
    spans = [[lengths[index_of[t]] for t in g.valid_tokens.tolist()] for g in decode_groups]
    assert all(len(s) >= MIN_ROWS_PER_DECODE_GROUP for s in spans)
    assert all(max(a) <= min(b) for a, b in zip(spans, spans[1:]))  # sorted by context


def test_fresh_prompts_take_the_causal_path_unless_there_is_a_window():
    _, requests, _, batch = _batch(_shapes())
    starts = [sum(len(r.token_ids) for r in requests[:i]) for i in range(len(requests))]
    assert batch.meta.fresh_prefills.spans == [(starts[20], 9), (starts[21], 3)]
    _, _, _, windowed = _batch(_shapes(), window=5)
    assert windowed.meta.fresh_prefills is None


def test_grouped_decodes_and_fresh_prompts_match_the_reference():
    for window in (None, 7):
        cache, requests, history, batch = _batch(_shapes(seed=1), window=window, seed=1)
        gen = torch.Generator().manual_seed(2)
        num_tokens = batch.meta.num_tokens
        q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen)
        k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
        write_kv(cache, batch.meta.slot_mapping, k, v)
        out = paged_attention(q, k, v, cache, batch.meta, HEAD_DIM ** -0.5)
        assert_matches_reference(out, q, k, v, requests, history, window)


def test_bfloat16_decodes_match_the_reference_to_bfloat16_precision():
    cache, requests, history, batch = _batch(_shapes(seed=3), seed=3)
    gen = torch.Generator().manual_seed(4)
    num_tokens = batch.meta.num_tokens
    q, k, v = (torch.randn(num_tokens, h, HEAD_DIM, generator=gen)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    write_kv(cache, batch.meta.slot_mapping, k, v)
    out = paged_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cache.bfloat16(), batch.meta,
                          HEAD_DIM ** -0.5)
    assert out.dtype == torch.bfloat16
    assert_matches_reference(out, q, k, v, requests, history, None, tolerance=3e-2)
