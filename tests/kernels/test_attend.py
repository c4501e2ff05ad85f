"""`attend`, the one attention entry of a CPU step (csrc/attention/attend.h), against the
PyTorch reference: decodes and prompt chunks split between paged_attention and
prefill_attention_bf16 as the kernels backend splits them, or every row to paged_attention;
and the same bits as calling the two kernels one after the other. Each test runs once per
build (`kernels`, tests/kernels/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from carpool.kernels.reference import paged_attention_reference

AS_INT = dict(dtype=torch.int32)
BLOCK_SIZE = 16


def make_step(seq_lens, q_lens, num_heads=4, num_kv_heads=2, head_dim=32,
              dtype=torch.float32, seed=0):
    """q [T, H, D] (rows packed in request order), a cache holding every request's keys and
    values in shuffled blocks, and the requests' int32 rows."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(needed) + 2
    cache = (torch.randn(2, num_kv_heads, num_blocks, BLOCK_SIZE, head_dim, generator=gen)
             .to(dtype))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(needed), **AS_INT)
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)], **AS_INT)
    starts = torch.tensor([0, *q_lens[:-1]], **AS_INT).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    rows = [tables, starts, torch.tensor(q_lens, **AS_INT), torch.tensor(seq_lens, **AS_INT)]
    return q, cache, rows


def pick(rows, requests):
    """The int32 rows of `requests` only (block tables kept whole)."""
    index = torch.tensor(requests, dtype=torch.long)
    return [t.index_select(0, index).contiguous() for t in rows]


def reference(q, cache, rows, scale, window=0):
    out = torch.zeros_like(q)
    paged_attention_reference(out, q, cache, *rows, scale, window)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 9])
def test_every_row_to_paged_attention(kernels, dtype, window):
    # decodes, a fresh prompt, a chunk after cached tokens
    q, cache, rows = make_step([40, 1 + 20, 33, 70], [1, 1, 33, 6], dtype=dtype)
    out = kernels.attend(q, cache, rows, [], 0.2, window, False, False)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), reference(q, cache, rows, 0.2, window).float(),
                               atol=tolerance, rtol=tolerance)
    same = torch.empty_like(q)
    kernels.paged_attention(same, q, cache, *rows, 0.2, window)
    assert torch.equal(out, same)  # the entry adds nothing to the kernel it calls


@pytest.mark.parametrize("amx", [False, True])
def test_prompt_chunks_to_the_prefill_kernel_and_decodes_to_paged_attention(kernels, amx):
    if not kernels.has_bf16_gemm():
        pytest.skip("no AVX512-BF16 here: prefill_attention_bf16 does not run")
    if amx and not kernels.has_amx():
        pytest.skip("no AMX here")
    q, cache, rows = make_step([40, 21, 33, 70], [1, 1, 33, 6], dtype=torch.bfloat16)
    decodes, chunks = pick(rows, [0, 1]), pick(rows, [2, 3])
    out = kernels.attend(q, cache, decodes, chunks, 0.2, 0, amx, False)
    torch.testing.assert_close(out.float(), reference(q, cache, rows, 0.2).float(),
                               atol=3e-2, rtol=3e-2)
    same = torch.empty_like(q)
    kernels.prefill_attention_bf16(same, q, cache, *chunks, 0.2, amx=amx)
    kernels.paged_attention(same, q, cache, *decodes, 0.2, 0)
    assert torch.equal(out, same)


def test_batch_invariant_rows_equal_their_own_attention(kernels):
    q, cache, rows = make_step([150, 20], [150, 5], head_dim=64, seed=3)
    whole = kernels.attend(q, cache, rows, [], 0.125, 0, False, True)
    alone = kernels.attend(q[:150].contiguous(), cache, pick(rows, [0]), [], 0.125, 0, False,
                           True)
    assert torch.equal(whole[:150], alone)


def test_attend_checks_its_rows(kernels):
    q, cache, rows = make_step([5], [5])
    with pytest.raises(RuntimeError, match="paged_rows must be empty or"):
        kernels.attend(q, cache, rows[:3], [], 0.2, 0, False, False)
    with pytest.raises(RuntimeError, match="a step has rows"):
        kernels.attend(q, cache, [], [], 0.2, 0, False, False)
