"""Every attention backend equals plain causal attention computed request by request,
and the backends agree with each other over random steps.

Steps mix decodes (enough to be cut into several length groups), prompts prefilled
from position 0, later chunks of a prompt whose history is in the cache, one-token
prompts and the static baseline's padding rows; block tables are shuffled (holes,
any order); with and without a sliding window; float32 and bfloat16.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from carpool import kernels as cpu_kernels
from carpool.attention import AttentionShape, create_backend, paged, resolve_backend_name
from carpool.attention.cpu_kernel import CpuKernelBackend, KernelMetadata
from carpool.attention.cpu_torch import CpuTorchBackend, CpuTorchMetadata
from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput
from carpool.runner.input_batch import build_input_batch
from carpool.sampling_params import SamplingParams

BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 4, 4, 2, 8
# cpu: with the compiled kernels (the C++ paged attention); cpu-pytorch: its PyTorch paths.
BACKENDS = ("cpu", "cpu-pytorch", "sdpa")
CPU = torch.device("cpu")


def make_backend(name, shape):
    if name == "cpu-pytorch":
        return create_backend("cpu", shape, CPU)
    kernels = cpu_kernels.load() if name == "cpu" else None
    assert name != "cpu" or kernels is not None, "the C++ kernels did not build"
    return create_backend(name, shape, CPU, kernels=kernels)


def _reference(q, keys, values, num_computed, window):
    """q [n, H, D] at positions num_computed.., keys/values [ctx, Hkv, D] of positions 0.."""
    groups = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(groups, dim=1)  # (ctx, H, D)
    v = values.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    q_pos = torch.arange(num_computed, num_computed + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


class Step:
    """Requests of (num_computed, num_new) over a fresh cache holding their random past K/V."""

    def __init__(self, shapes, *, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                 num_padding=0, seed=0, spare_blocks=3):
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        num_blocks = sum(-(-(c + n) // BLOCK_SIZE) for c, n in shapes) + spare_blocks
        self.cache = torch.zeros(2, kv_heads, num_blocks + 1, BLOCK_SIZE, head_dim)
        free = list(range(num_blocks))
        rng.shuffle(free)  # block tables with holes, in any order
        self.requests, self.history = [], []
        for i, (num_computed, num_new) in enumerate(shapes):
            blocks = [free.pop() for _ in range(-(-(num_computed + num_new) // BLOCK_SIZE))]
            past = torch.randn(2, num_computed, kv_heads, head_dim, generator=gen)
            for pos in range(num_computed):  # earlier steps' keys, already in the cache
                self.cache[:, :, blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = past[:, pos]
            self.requests.append(ScheduledRequest(f"r{i}", [1] * num_new, num_computed, blocks,
                                                  True, SamplingParams()))
            self.history.append(past)
        self.batch = build_input_batch(SchedulerOutput(self.requests,
                                                       num_padding_tokens=num_padding),
                                       block_size=BLOCK_SIZE, scratch_block=num_blocks,
                                       device=CPU)
        num_tokens = self.batch.layout.num_tokens
        self.q = torch.randn(num_tokens, heads, head_dim, generator=gen)
        self.k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
        self.v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
        self.shape = (heads, kv_heads, head_dim)

    def run(self, backend_name, window=None, dtype=torch.float32):
        backend = make_backend(backend_name, AttentionShape(*self.shape, window))
        meta = backend.build_metadata(self.batch.layout)
        cache = self.cache.to(dtype)
        out = backend.forward(self.q.to(dtype), self.k.to(dtype), self.v.to(dtype), cache, meta,
                              self.shape[2] ** -0.5)
        assert out.dtype == dtype
        return out, cache

    def assert_matches_reference(self, out, window, tolerance=1e-5):
        start = 0
        for req, past in zip(self.requests, self.history):
            n = len(req.token_ids)
            expected = _reference(self.q[start:start + n],
                                  torch.cat([past[0], self.k[start:start + n]]),
                                  torch.cat([past[1], self.v[start:start + n]]),
                                  req.num_computed_tokens, window)
            torch.testing.assert_close(out[start:start + n].float(), expected, atol=tolerance,
                                       rtol=tolerance)
            start += n


def _mixed_shapes(rng, num_decodes=40):
    decodes = [(rng.randint(1, 60), 1) for _ in range(num_decodes)]
    return (decodes[:20] + [(0, 9), (0, 3), (0, 1)] + decodes[20:]
            + [(11, 5), (rng.randint(1, 30), rng.randint(2, 20))])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, 5])
def test_matches_per_request_reference(backend, window):
    # Decodes, a first chunk, a later chunk, a one-token prompt, and padding rows.
    step = Step([(9, 1), (0, 7), (13, 6), (0, 1), (30, 1)], num_padding=3)
    out, cache = step.run(backend, window)
    step.assert_matches_reference(out, window)
    assert torch.isfinite(out).all()
    # The new keys and values were written at their slots.
    slots = cache.view(2, KV_HEADS, -1, HEAD_DIM)[:, :, step.batch.layout.slot_mapping]
    torch.testing.assert_close(slots[0].transpose(0, 1)[:-3], step.k[:-3])
    torch.testing.assert_close(slots[1].transpose(0, 1)[:-3], step.v[:-3])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, 7])
def test_grouped_decodes_and_fresh_prompts_match_the_reference(backend, window):
    step = Step(_mixed_shapes(random.Random(1)), seed=1)
    out, _ = step.run(backend, window)
    step.assert_matches_reference(out, window)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_matches_the_reference_to_bfloat16_precision(backend):
    step = Step(_mixed_shapes(random.Random(3)), seed=3)
    out, _ = step.run(backend, dtype=torch.bfloat16)
    step.assert_matches_reference(out, None, tolerance=3e-2)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 1, 16), (6, 2, 40), (4, 4, 8)])
def test_backends_agree_over_random_steps(heads, kv_heads, head_dim):
    """MQA, head_dim 40, MHA; each seed a different mix of requests and a window or none."""
    for seed in range(6):
        rng = random.Random(seed)
        shapes = [(rng.choice([0, 0, rng.randint(1, 70)]), rng.choice([1, 1, 1, rng.randint(1, 24)]))
                  for _ in range(rng.randint(1, 45))]
        window = rng.choice([None, None, rng.randint(1, 20)])
        step = Step(shapes, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                    num_padding=rng.choice([0, 2]), seed=seed)
        sdpa_out, _ = step.run("sdpa", window)
        for name in ("cpu", "cpu-pytorch"):
            out, _ = step.run(name, window)
            torch.testing.assert_close(out, sdpa_out, atol=1e-5, rtol=1e-5)


def test_decodes_are_grouped_by_context_length_and_each_appears_once():
    step = Step(_mixed_shapes(random.Random(0)))
    layout = step.batch.layout
    split = paged.split_step(layout, fresh_fast_path=True)
    decodes = np.flatnonzero(layout.query_lens == 1)
    assert len(split.decode_groups) > 1
    assert sorted(np.concatenate(split.decode_groups)) == sorted(decodes)
    lengths = [layout.num_computed[g] for g in split.decode_groups]
    assert all(len(g) >= paged.MIN_ROWS_PER_DECODE_GROUP for g in split.decode_groups)
    assert all(a.max() <= b.min() for a, b in zip(lengths, lengths[1:]))  # sorted by context


def test_sdpa_on_cuda_attends_every_decode_in_one_group():
    """On a GPU each group is launches on the host's critical path (BENCHMARKS.md §35)."""
    shape = AttentionShape(HEADS, KV_HEADS, HEAD_DIM)
    assert create_backend("sdpa", shape, torch.device("cuda")).max_decode_groups == 1
    assert create_backend("sdpa", shape, CPU).max_decode_groups == paged.MAX_DECODE_GROUPS
    step = Step(_mixed_shapes(random.Random(0)))
    layout = step.batch.layout
    (group,) = paged.split_step(layout, fresh_fast_path=True, max_decode_groups=1).decode_groups
    assert sorted(group) == sorted(np.flatnonzero(layout.query_lens == 1))
    with pytest.raises(ValueError, match="max_decode_groups"):
        paged.split_step(layout, fresh_fast_path=True, max_decode_groups=0)


@pytest.mark.parametrize("window", [None, 5])
def test_sdpa_with_one_decode_group_matches_the_reference(window):
    step = Step(_mixed_shapes(random.Random(1)))
    backend = make_backend("sdpa", AttentionShape(HEADS, KV_HEADS, HEAD_DIM, window))
    backend.max_decode_groups = 1  # what it is on CUDA
    meta = backend.build_metadata(step.batch.layout)
    assert len(meta.groups) == 2  # every decode, then the chunks
    out = backend.forward(step.q, step.k, step.v, step.cache.clone(), meta, HEAD_DIM ** -0.5)
    step.assert_matches_reference(out, window)


def test_fresh_prompts_take_the_causal_path_unless_there_is_a_window():
    step = Step(_mixed_shapes(random.Random(0)))
    layout = step.batch.layout
    split = paged.split_step(layout, fresh_fast_path=True)
    starts = [sum(len(r.token_ids) for r in step.requests[:i]) for i in range(len(step.requests))]
    assert paged.fresh_spans(layout, split.fresh) == ((starts[20], 9), (starts[21], 3))
    assert paged.split_step(layout, fresh_fast_path=False).fresh.size == 0


def test_metadata_is_frozen():
    step = Step([(9, 1), (0, 7)])
    for name in BACKENDS:
        backend = make_backend(name, AttentionShape(HEADS, KV_HEADS, HEAD_DIM))
        meta = backend.build_metadata(step.batch.layout)
        with pytest.raises(AttributeError):
            meta.slot_mapping = None


def test_backend_names_are_checked():
    shape = AttentionShape(HEADS, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="attention_backend"):
        create_backend("flash", shape, CPU)
    with pytest.raises(ValueError, match="attention_backend 'cpu' does not run on cuda"):
        create_backend("cpu", shape, torch.device("cuda"))
    assert create_backend("auto", shape, CPU).name == "cpu"
    assert resolve_backend_name("auto", "cuda") == "sdpa"


def test_config_names_the_registered_backends():
    from carpool.attention import BACKEND_NAMES
    from carpool.config import ATTENTION_BACKENDS, EngineConfig

    assert ATTENTION_BACKENDS == BACKEND_NAMES
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")


def test_cpu_backend_keeps_its_pytorch_paths_above_the_kernels_head_dim():
    kernels = cpu_kernels.load()
    assert kernels.max_head_dim() >= 128
    wide = AttentionShape(2, 1, kernels.max_head_dim() + 16)
    backend = create_backend("cpu", wide, CPU, kernels=kernels)
    assert type(backend) is CpuTorchBackend and backend.kernels is None
    fits = AttentionShape(2, 1, kernels.max_head_dim())
    backend = create_backend("cpu", fits, CPU, kernels=kernels)
    assert type(backend) is CpuKernelBackend and backend.kernels is kernels


def test_the_cpu_name_resolves_to_one_backend_with_one_metadata_shape():
    """Without kernels the PyTorch backend and its groups; with them the kernels backend and
    its rows, every field set by every step."""
    step = Step([(9, 1), (0, 7), (4, 3)])
    shape = AttentionShape(HEADS, KV_HEADS, HEAD_DIM)
    meta = make_backend("cpu-pytorch", shape).build_metadata(step.batch.layout)
    assert type(meta) is CpuTorchMetadata and len(meta.fresh_spans) == 1
    assert meta.chunk_group is not None and len(meta.decode_groups) == len(meta.decode_bags) == 1
    meta = make_backend("cpu", shape).build_metadata(step.batch.layout)
    assert type(meta) is KernelMetadata and meta.paged_rows.query_lens.tolist() == [1, 7, 3]


def test_the_kernel_takes_every_row_long_fresh_prompts_included():
    """With the kernels, fresh prompts of any length go through the kernel too (it beats the
    query-block matmuls at every length measured,
    docs/lab/17-the-paged-attention-kernel-second-pass.md)."""
    long = 2 * 16 * 64 + 5  # two of the kernel's query tiles over more than 30 key chunks
    step = Step([(0, 9), (12, 1), (0, long), (0, 3)], seed=4)
    backend = make_backend("cpu", AttentionShape(HEADS, KV_HEADS, HEAD_DIM, None))
    meta = backend.build_metadata(step.batch.layout)
    assert isinstance(meta, KernelMetadata) and meta.prefill_rows is None  # float32 shape
    assert meta.paged_rows.query_lens.tolist() == [9, 1, long, 3]
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        out, _ = step.run("cpu", dtype=dtype)
        step.assert_matches_reference(out, None, tolerance)
