"""prefill_attention_bf16 (csrc/attention/prefill_attention.cpp: bfloat16 prompt chunks on
AVX512-BF16, or on AMX tiles) against its PyTorch reference."""

from __future__ import annotations

import math

import pytest
import torch

from carpool import kernels as cpu_kernels
from carpool.kernels.reference import prefill_attention_bf16_reference

UNTOUCHED = 7.0
AS_INT = dict(dtype=torch.int32)


@pytest.fixture(scope="module")
def kernels():
    """This CPU's build only: the kernel needs AVX512-BF16, which no AVX2 build has."""
    module = cpu_kernels.load()
    if module is None or not module.has_bf16_gemm():
        pytest.skip("no compiled kernels or no AVX512-BF16 on this CPU")
    return module


def chunk_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size=16, seed=0,
               shared_blocks=()):
    """bfloat16 q (a strided view), a cache whose slots no request owns are NaN, shuffled
    block tables, and the requests' rows placed in q in a shuffled order after spare rows.
    shared_blocks[i]: request i's first blocks are those of request 0 (a shared prefix)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(needed) + 3
    cache = torch.full((2, num_kv_heads, num_blocks, block_size, head_dim), float("nan"))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(needed) + 1, **AS_INT)
    for i, (n, seq_len) in enumerate(zip(needed, seq_lens)):
        shared = shared_blocks[i] if i < len(shared_blocks) else 0
        ids = tables[0, :shared].tolist() + [order.pop() for _ in range(n - shared)]
        tables[i, :n] = torch.tensor(ids, **AS_INT)
        for b, block in enumerate(ids[shared:], start=shared):
            rows = min(block_size, seq_len - b * block_size)
            cache[:, :, block, :rows] = torch.randn(2, num_kv_heads, rows, head_dim,
                                                    generator=gen) * 2
    starts, row = [0] * len(q_lens), 2
    for i in torch.randperm(len(q_lens), generator=gen).tolist():
        starts[i], row = row, row + q_lens[i]
    wide = torch.randn(row + 1, num_heads, head_dim + 8, generator=gen) * 2
    q = wide[..., :head_dim].to(torch.bfloat16)  # token and head strides of a wider tensor
    return dict(q=q, kv_cache=cache.to(torch.bfloat16), block_tables=tables,
                query_starts=torch.tensor(starts, **AS_INT),
                query_lens=torch.tensor(q_lens, **AS_INT),
                seq_lens=torch.tensor(seq_lens, **AS_INT))


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,q_lens,seq_lens", [
    (9, 3, 64, [2, 37, 300, 65], [2, 37, 300, 65]),  # fresh prompts around the 32/64 tiles
    (9, 3, 64, [32, 5, 100], [800, 21, 164]),  # chunks after cached tokens (prefix hits)
    (4, 1, 16, [16, 97, 3], [16, 200, 64]),  # MQA
    (8, 8, 128, [130], [130]),  # MHA, wide heads
    (6, 2, 32, [513, 0], [513, 40]),  # a request with no queries is skipped
    (4, 1, 256, [70, 3], [90, 3]),  # the widest heads; a tile of 3 rows (13 of padding)
])
@pytest.mark.parametrize("amx", [False, True], ids=["avx512-bf16", "amx"])
def test_prefill_kernel_matches_reference(kernels, num_heads, num_kv_heads, head_dim, q_lens,
                                          seq_lens, amx):
    """Both paths: vdpbf16ps, and (where the CPU has AMX, head_dim in 32s) the tile unit."""
    if amx and not (kernels.has_amx() and head_dim % 32 == 0):
        pytest.skip("no AMX on this CPU, or a head_dim the AMX path does not take")
    case = chunk_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim)
    scale = head_dim ** -0.5
    out, expected = (torch.full_like(case["q"], UNTOUCHED) for _ in range(2))
    kernels.prefill_attention_bf16(out, **case, scale=scale, amx=amx)
    prefill_attention_bf16_reference(expected, **case, scale=scale)
    covered = expected != UNTOUCHED
    assert torch.equal(out[~covered], expected[~covered])  # rows outside the requests untouched
    # bfloat16 inputs and probabilities: within a few bfloat16 steps of the float32 reference
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("amx", [False, True], ids=["avx512-bf16", "amx"])
def test_prefill_kernel_running_max_moves_past_its_slack(kernels, amx):
    """Sharp scores (q x 8) rising along the keys (each block's keys scaled by its place in
    the table): a row's running max, which moves only when a score passes it by more than a
    slack, moves in most key chunks, and its sums and output are rescaled each time."""
    if amx and not kernels.has_amx():
        pytest.skip("no AMX on this CPU")
    seq_lens = [300, 90]
    case = chunk_case([300, 70], seq_lens, 9, 3, 64)
    case["q"] = case["q"] * 8
    keys = case["kv_cache"][0]
    for i, seq_len in enumerate(seq_lens):
        for b in range(math.ceil(seq_len / 16)):
            keys[:, case["block_tables"][i, b]] *= 1 + b / 4
    scale = 64 ** -0.5
    out, expected = (torch.full_like(case["q"], UNTOUCHED) for _ in range(2))
    kernels.prefill_attention_bf16(out, **case, scale=scale, amx=amx)
    prefill_attention_bf16_reference(expected, **case, scale=scale)
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size", [4, 32, 48])
def test_prefill_kernel_reads_any_block_size(kernels, block_size):
    """Keys are packed 16 at a time from one block's consecutive rows where the block size
    is a multiple of 16, else key by key; odd lengths leave a value row paired with zeros."""
    case = chunk_case([32, 7, 45], [801, 7, 99], 9, 3, 64, block_size=block_size)
    scale = 64 ** -0.5
    out, expected = (torch.full_like(case["q"], UNTOUCHED) for _ in range(2))
    kernels.prefill_attention_bf16(out, **case, scale=scale, amx=kernels.has_amx())
    prefill_attention_bf16_reference(expected, **case, scale=scale)
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("amx", [False, True], ids=["avx512-bf16", "amx"])
def test_prefill_kernel_reads_a_shared_prefix_packed_once(kernels, amx):
    """Requests whose tables start with request 0's blocks (a cached prefix, or one request 0
    computes in this step) read those keys from request 0's packing, in whole 64-key chunks:
    shares of 50 blocks (800 keys: 12 chunks and a part), 4 (one chunk), 3 (none whole)."""
    if amx and not kernels.has_amx():
        pytest.skip("no AMX on this CPU")
    case = chunk_case([800, 32, 9, 40, 5], [800, 832, 809, 100, 60], 9, 3, 64,
                      shared_blocks=[0, 50, 50, 4, 3])
    scale = 64 ** -0.5
    out, expected = (torch.full_like(case["q"], UNTOUCHED) for _ in range(2))
    kernels.prefill_attention_bf16(out, **case, scale=scale, amx=amx)
    prefill_attention_bf16_reference(expected, **case, scale=scale)
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=2e-2)


def test_prefill_kernel_checks_its_arguments(kernels):
    case = chunk_case([8], [8], 4, 2, 16)
    out = torch.zeros_like(case["q"])
    bad_table = dict(case, block_tables=torch.full_like(case["block_tables"], 999))
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.prefill_attention_bf16(out, **bad_table, scale=0.25)
    with pytest.raises(RuntimeError, match="exceed"):
        kernels.prefill_attention_bf16(out, **dict(case, seq_lens=torch.tensor([4], **AS_INT)),
                                       scale=0.25)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.prefill_attention_bf16(out.float(), **dict(case, q=case["q"].float()), scale=0.25)
    assert not kernels.prefill_head_dim_ok(40) and kernels.prefill_head_dim_ok(64)
    with pytest.raises(RuntimeError, match="amx needs"):  # head_dim 16: not in 32s
        kernels.prefill_attention_bf16(out, **case, scale=0.25, amx=True)
