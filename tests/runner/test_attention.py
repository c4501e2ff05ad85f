"""Paged attention equals plain causal attention computed request by request."""

from __future__ import annotations

import random

import pytest
import torch

from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput
from carpool.runner.attention import paged_attention, write_kv
from carpool.runner.input_batch import build_input_batch
from carpool.sampling_params import SamplingParams

BLOCK_SIZE, NUM_BLOCKS, HEADS, KV_HEADS, HEAD_DIM = 4, 64, 4, 2, 8


def _reference(q, keys, values, num_computed, window):
    """q [n, H, D] at positions num_computed.., keys/values [ctx, Hkv, D] of positions 0.."""
    groups = HEADS // KV_HEADS
    k = keys.repeat_interleave(groups, dim=1)  # (ctx, H, D)
    v = values.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM ** 0.5
    q_pos = torch.arange(num_computed, num_computed + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def assert_matches_reference(out, q, k, v, requests, history, window, tolerance=1e-5):
    """Each request's rows of `out` (packed order) equal `_reference` over its past + new K/V.

    history[i] holds request i's past keys and values ([0] and [1], [ctx, Hkv, D] each).
    """
    start = 0
    for req, past in zip(requests, history):
        n = len(req.token_ids)
        expected = _reference(q[start:start + n], torch.cat([past[0], k[start:start + n]]),
                              torch.cat([past[1], v[start:start + n]]), req.num_computed_tokens,
                              window)
        torch.testing.assert_close(out[start:start + n].float(), expected, atol=tolerance,
                                   rtol=tolerance)
        start += n


@pytest.mark.parametrize("window", [None, 5])
def test_matches_per_request_reference(window):
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(2, KV_HEADS, NUM_BLOCKS + 1, BLOCK_SIZE, HEAD_DIM)  # head-major
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    # (num_computed, num_new): decodes, a first chunk, a later chunk, a one-token prompt.
    shapes = [(9, 1), (0, 7), (13, 6), (0, 1), (30, 1)]
    requests, history = [], []
    for i, (num_computed, num_new) in enumerate(shapes):
        total = num_computed + num_new
        blocks = [free.pop() for _ in range(-(-total // BLOCK_SIZE))]
        past_k = torch.randn(num_computed, KV_HEADS, HEAD_DIM, generator=gen)
        past_v = torch.randn(num_computed, KV_HEADS, HEAD_DIM, generator=gen)
        for pos in range(num_computed):  # earlier steps' keys, already in the cache
            cache[0, :, blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = past_k[pos]
            cache[1, :, blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = past_v[pos]
        requests.append(ScheduledRequest(f"r{i}", [1] * num_new, num_computed, blocks, True,
                                         SamplingParams()))
        history.append((past_k, past_v))
    batch = build_input_batch(SchedulerOutput(requests, num_padding_tokens=3),
                              block_size=BLOCK_SIZE, scratch_block=NUM_BLOCKS,
                              device=torch.device("cpu"), sliding_window=window)
    num_tokens = batch.meta.num_tokens
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
    write_kv(cache, batch.meta.slot_mapping, k, v)
    out = paged_attention(q, k, v, cache, batch.meta, HEAD_DIM ** -0.5)
    assert_matches_reference(out, q, k, v, requests, history, window)
    assert torch.isfinite(out).all()
