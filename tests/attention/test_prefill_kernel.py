"""The bfloat16 prefill kernel (fresh prompts, AVX512-BF16) against the PyTorch reference,
and the cpu backend taking it for every fresh bfloat16 prompt and for nothing else."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from carpool.attention import AttentionShape, create_backend
from carpool.attention.base import StepLayout
from carpool.attention.cpu_kernels import load, paged_attention_reference

UNTOUCHED = 7.0


@pytest.fixture(scope="module")
def kernels():
    module = load()
    if module is None or not module.has_bf16_gemm():
        pytest.skip("no compiled kernels or no AVX512-BF16 on this CPU")
    return module


def fresh_case(lengths, num_heads, num_kv_heads, head_dim, seed=0, spare_rows=3):
    """q, k, v as strided views of one projection output; prompts packed after spare rows."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(lengths) + spare_rows
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 2
    q, k, v = qkv.to(torch.bfloat16).split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    starts = np.cumsum([spare_rows // 2, *lengths[:-1]])
    return (q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim), starts.astype(np.int32))


def reference(q, k, v, starts, lengths, scale):
    """paged_attention_reference over a cache holding each prompt's k, v in blocks of 16."""
    block_size, num_tokens = 16, q.shape[0]
    blocks = [-(-n // block_size) for n in lengths]
    cache = torch.zeros(2, k.shape[1], sum(blocks), block_size, k.shape[2], dtype=k.dtype)
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    first = 0
    for i, (start, n) in enumerate(zip(starts, lengths)):
        ids = torch.arange(first, first + blocks[i])
        tables[i, :blocks[i]] = ids.int()
        flat = cache.view(2, k.shape[1], -1, k.shape[2])
        slots = first * block_size + torch.arange(n)
        flat[0][:, slots] = k[start:start + n].transpose(0, 1)
        flat[1][:, slots] = v[start:start + n].transpose(0, 1)
        first += blocks[i]
    out = torch.full_like(q, UNTOUCHED)
    as_int = dict(dtype=torch.int32)
    paged_attention_reference(out, q, cache, tables, torch.tensor(starts, **as_int),
                              torch.tensor(lengths, **as_int), torch.tensor(lengths, **as_int),
                              scale, 0)
    assert out.shape[0] == num_tokens
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,lengths", [
    (9, 3, 64, [2, 37, 300, 65]),  # 135M's shape; prompt lengths around the 32/64 tiles
    (4, 1, 16, [1, 16, 64, 97]),  # MQA, one-token prompt
    (8, 8, 128, [130]),  # MHA, wide heads
    (6, 2, 32, [513]),
])
def test_prefill_kernel_matches_reference(kernels, num_heads, num_kv_heads, head_dim, lengths):
    q, k, v, starts = fresh_case(lengths, num_heads, num_kv_heads, head_dim)
    out = torch.full_like(q, UNTOUCHED)
    scale = head_dim ** -0.5
    kernels.prefill_attention_bf16(out, q, k, v, torch.from_numpy(starts),
                                   torch.tensor(lengths, dtype=torch.int32), scale)
    expected = reference(q, k, v, starts, lengths, scale)
    covered = expected != UNTOUCHED
    assert torch.equal(out[~covered], expected[~covered])  # rows outside the prompts untouched
    # bfloat16 inputs and probabilities: within a few bfloat16 steps of the float32 reference
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=2e-2)


def test_prefill_kernel_checks_its_arguments(kernels):
    q, k, v, starts = fresh_case([8], 4, 2, 16)
    out = torch.zeros_like(q)
    with pytest.raises(RuntimeError, match="fall outside q"):
        kernels.prefill_attention_bf16(out, q, k, v, torch.tensor([5], dtype=torch.int32),
                                       torch.tensor([100], dtype=torch.int32), 0.25)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.prefill_attention_bf16(out.float(), q.float(), k.float(), v.float(),
                                       torch.from_numpy(starts), torch.tensor([8], dtype=torch.int32),
                                       0.25)
    assert not kernels.prefill_head_dim_ok(40) and kernels.prefill_head_dim_ok(64)


@pytest.mark.parametrize("dtype,takes_it", [(torch.bfloat16, True), (torch.float32, False)])
def test_cpu_backend_sends_fresh_bfloat16_prompts_to_the_prefill_kernel(kernels, dtype, takes_it):
    shape = AttentionShape(4, 2, 16, dtype=dtype)
    backend = create_backend("cpu", shape, torch.device("cpu"), kernels=kernels)
    assert backend.bf16_prefill is takes_it
    # one fresh prompt of 40 tokens and one decode at position 20 (a cached request)
    layout = StepLayout(query_starts=np.array([0, 40]), query_lens=np.array([40, 1]),
                        num_computed=np.array([0, 20]),
                        block_tables=(np.array([1, 2, 3]), np.array([4, 5])),
                        slot_mapping=np.concatenate([np.arange(16, 56), [84]]),
                        num_cache_blocks=6, block_size=16)
    meta = backend.build_metadata(layout)
    assert (meta.fresh_spans == ((0, 40),)) is takes_it
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(41, h, 16, generator=gen).to(dtype) for h in (4, 2, 2))
    cache = torch.randn(2, 2, 6, 16, 16, generator=gen).to(dtype)
    out = backend.forward(q, k, v, cache, meta, 0.25)
    expected = torch.full_like(q, UNTOUCHED)
    as_int = dict(dtype=torch.int32)
    paged_attention_reference(expected, q, cache, torch.tensor([[1, 2, 3], [4, 5, 0]], **as_int),
                              torch.tensor([0, 40], **as_int), torch.tensor([40, 1], **as_int),
                              torch.tensor([40, 21], **as_int), 0.25, 0)
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=2e-2)
