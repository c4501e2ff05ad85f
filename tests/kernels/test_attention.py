"""paged_attention (csrc/attention/paged_attention.cpp) against its PyTorch reference, on
every build this CPU runs: decodes, prompt chunks and both mixed, every head grouping,
float32 and reduced precision, sliding windows, block edges, strided rows, its checks."""

from __future__ import annotations

import math

import pytest
import torch

from carpool.kernels.reference import paged_attention_reference

UNTOUCHED = 7.0  # what out holds before the call; rows no request covers must keep it


def make_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, block_size=16,
              seed=0, spare_rows=3):
    """Random q, a cache whose unused blocks and slots are NaN, shuffled non-sequential block
    tables padded with invalid ids, and requests placed in q in a shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil(s / block_size) for s in seq_lens]
    num_cache_blocks = sum(blocks_needed) + 5  # some blocks belong to nobody (holes)
    kv_cache = torch.full((2, num_kv_heads, num_cache_blocks, block_size, head_dim), float("nan"))
    order = torch.randperm(num_cache_blocks, generator=gen).tolist()
    table_width = max(blocks_needed) + 2
    block_tables = torch.full((len(seq_lens), table_width), 10**6, dtype=torch.int32)  # pads
    for i, (num_blocks, seq_len) in enumerate(zip(blocks_needed, seq_lens)):
        ids = [order.pop() for _ in range(num_blocks)]
        block_tables[i, :num_blocks] = torch.tensor(ids, dtype=torch.int32)
        for b, block in enumerate(ids):  # fill only the slots at positions < seq_len
            rows = min(block_size, seq_len - b * block_size)
            kv_cache[:, :, block, :rows] = torch.randn(2, num_kv_heads, rows, head_dim,
                                                       generator=gen)
    num_tokens = sum(q_lens) + spare_rows
    starts, row = [0] * len(q_lens), spare_rows // 2
    for i in torch.randperm(len(q_lens), generator=gen).tolist():
        starts[i], row = row, row + q_lens[i]
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    as_int = dict(dtype=torch.int32)
    return dict(q=q.to(dtype), kv_cache=kv_cache.to(dtype), block_tables=block_tables,
                query_starts=torch.tensor(starts, **as_int),
                query_lens=torch.tensor(q_lens, **as_int),
                seq_lens=torch.tensor(seq_lens, **as_int))


def check_against_reference(kernels, case, sliding_window=0, scale=0.125, **options):
    q = case["q"]
    expected = torch.full_like(q, UNTOUCHED)
    actual = torch.full_like(q, UNTOUCHED)
    args = (case["kv_cache"], case["block_tables"], case["query_starts"], case["query_lens"],
            case["seq_lens"], scale, sliding_window)
    paged_attention_reference(expected, q, *args)
    kernels.paged_attention(actual, q, *args, **options)
    tol = 1e-5 if q.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)
    covered = torch.zeros(q.shape[0], dtype=torch.bool)
    for start, q_len in zip(case["query_starts"].tolist(), case["query_lens"].tolist()):
        covered[start:start + q_len] = True
    assert (actual[~covered] == UNTOUCHED).all()
    assert not actual[covered].isnan().any()


HEADS = [(4, 4), (9, 3), (16, 2), (4, 1)]  # (H, Hkv): group sizes 1, 3, 8, and MQA (G 4)


def lengths(kind, num_seqs, gen_seed):
    """(q_lens, seq_lens) for decodes, prompt chunks continuing a prefix, or both mixed."""
    gen = torch.Generator().manual_seed(gen_seed)
    q_lens, seq_lens = [], []
    for i in range(num_seqs):
        chunk = kind == "chunk" or (kind == "mixed" and i % 2 == 0)
        q_len = int(torch.randint(2, 40, (1,), generator=gen)) if chunk else 1
        q_lens.append(q_len)
        seq_lens.append(q_len + int(torch.randint(0, 70, (1,), generator=gen)))
    return q_lens, seq_lens


@pytest.mark.parametrize("kind", ["decode", "chunk", "mixed"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("head_dim", [16, 40, 64, 128])
def test_matches_reference_float32(kernels, kind, heads, head_dim):
    q_lens, seq_lens = lengths(kind, 6, gen_seed=head_dim + heads[0])
    case = make_case(q_lens, seq_lens, *heads, head_dim, torch.float32, seed=head_dim)
    check_against_reference(kernels, case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("head_dim", [16, 32, 40, 48, 64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}-Hkv{h[1]}")
def test_matches_reference_reduced_precision(kernels, dtype, kind, head_dim, heads):
    """bfloat16/float16 rows are read in place or through a float32 copy, by head_dim and G
    (16 and 48: an odd number of vectors, which the bfloat16 pair path must leave alone)."""
    q_lens, seq_lens = lengths(kind, 8, gen_seed=1)
    case = make_case(q_lens, seq_lens, *heads, head_dim, dtype, seed=2)
    check_against_reference(kernels, case)


@pytest.mark.parametrize("sliding_window", [1, 5, 17, 64])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_sliding_window(kernels, sliding_window, kind):
    q_lens, seq_lens = lengths(kind, 6, gen_seed=sliding_window)
    case = make_case(q_lens, seq_lens, 9, 3, 64, torch.float32, seed=3)
    check_against_reference(kernels, case, sliding_window=sliding_window)


@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_lengths_at_block_edges(kernels, block_size):
    """seq_len 1, exactly one and two blocks, one past a block, a whole prompt as one chunk."""
    seq_lens = [1, block_size, 2 * block_size, block_size + 1, 2 * block_size, 3]
    q_lens = [1, 1, 1, 1, 2 * block_size, 3]
    case = make_case(q_lens, seq_lens, 6, 2, 64, torch.float32, block_size=block_size, seed=4)
    check_against_reference(kernels, case)


@pytest.mark.parametrize("block_size", [1, 5, 16, 128])
@pytest.mark.parametrize("sliding_window", [0, 50])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_contexts_over_several_key_chunks(kernels, block_size, sliding_window, dtype):
    """The kernel takes keys in chunks of whole blocks (about 64 keys, 128 for 128-key
    blocks): contexts of several chunks, prompt tiles that cross a chunk's edge, windows
    that start inside one."""
    seq_lens = [200, 130, 77, 140, 65]
    q_lens = [1, 40, 1, 17, 65]
    case = make_case(q_lens, seq_lens, 9, 3, 64, dtype, block_size=block_size, seed=7)
    check_against_reference(kernels, case, sliding_window=sliding_window)


def test_long_contexts_bfloat16(kernels):
    """Contexts up to 2048 keys, where a float32 online softmax matters."""
    seq_lens = [16, 300, 1025, 2048]
    case = make_case([1, 1, 1, 17], seq_lens, 9, 3, 64, torch.bfloat16, seed=5)
    check_against_reference(kernels, case)


@pytest.mark.parametrize("block_size", [5, 16, 32])
@pytest.mark.parametrize("sliding_window", [0, 21])
@pytest.mark.parametrize("heads", [(8, 1), (9, 3)], ids=lambda h: f"H{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 16), (torch.float32, 48),
                                            (torch.float32, 256), (torch.bfloat16, 16),
                                            (torch.bfloat16, 32), (torch.bfloat16, 96),
                                            (torch.bfloat16, 256)],
                         ids=lambda x: str(x).removeprefix("torch."))
def test_decode_loops(kernels, block_size, sliding_window, heads, dtype, head_dim):
    """Decodes take their own loops: on AVX512 CPUs one pass for float32 of head_dim a
    multiple of 16 and bfloat16 of a multiple of 32 (with AVX512-BF16), key pairs for
    bfloat16 of head_dim 16 (with AVX512-BF16); on AVX2 ones one pass for both of a
    multiple of 16 (groups of 8 keys). Groups of 16 keys within a block
    (blocks of 5 hold fewer), windows that start inside a group, every query head of a kv
    head (one or several register passes of the value sums), contexts shorter than one
    group."""
    if head_dim > kernels.max_head_dim():
        pytest.skip(f"this build takes head_dim up to {kernels.max_head_dim()}")
    seq_lens = [1, 7, 16, 17, 90, 200]
    case = make_case([1] * len(seq_lens), seq_lens, *heads, head_dim, dtype,
                     block_size=block_size, seed=head_dim + block_size)
    check_against_reference(kernels, case, sliding_window=sliding_window)


@pytest.mark.parametrize("scale", [0.5, 3.0])
@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.bfloat16, 64),
                                            (torch.bfloat16, 16)],
                         ids=lambda x: str(x).removeprefix("torch."))
def test_decode_loops_follow_a_max_that_moves(kernels, dtype, head_dim, scale):
    """The decode loops move their running max only when a score passes it by more than a
    slack: scores spread wide (scale 3: a later group often passes the max by more, so the
    sums are rescaled) and narrow (scale 0.5: within the slack, probabilities above 1)."""
    seq_lens = [3, 40, 333, 1024]
    case = make_case([1] * len(seq_lens), seq_lens, 9, 3, head_dim, dtype, seed=11)
    check_against_reference(kernels, case, scale=scale)


@pytest.mark.parametrize("widen", [0, 1], ids=["vdpbf16ps", "widened"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 256])
@pytest.mark.parametrize("scale", [0.125, 3.0])
def test_bfloat16_decodes_by_either_product(kernels, widen, head_dim, scale):
    """AVX-512 bfloat16 decodes take their products by vdpbf16ps, or by FMAs on rows widened
    to float32 (bf16_widen; by default the CPU picks: Intel widens): both paths, whichever
    this CPU picks, with the running max moving (scale 3) and not, one and several register
    passes of query rows."""
    if head_dim > kernels.max_head_dim():
        pytest.skip(f"this build takes head_dim up to {kernels.max_head_dim()}")
    seq_lens = [1, 17, 90, 333]
    case = make_case([1] * len(seq_lens), seq_lens, 9, 3, head_dim, torch.bfloat16,
                     seed=head_dim + widen)
    check_against_reference(kernels, case, scale=scale, bf16_widen=widen)


def test_bf16_widen_is_checked(kernels):
    case = make_case([1], [40], 9, 3, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16_widen must be"):
        kernels.paged_attention(torch.empty_like(case["q"]), case["q"], case["kv_cache"],
                                case["block_tables"], case["query_starts"],
                                case["query_lens"], case["seq_lens"], 0.125, 0, bf16_widen=2)


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.bfloat16, 64),
                                            (torch.bfloat16, 16)],
                         ids=lambda x: str(x).removeprefix("torch."))
def test_decode_loops_reject_a_block_outside_the_cache(kernels, dtype, head_dim):
    case = make_case([1], [40], 9, 3, head_dim, dtype)
    case["block_tables"][0, 1] = case["kv_cache"].shape[2]
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.paged_attention(torch.empty_like(case["q"]), case["q"], case["kv_cache"],
                                case["block_tables"], case["query_starts"],
                                case["query_lens"], case["seq_lens"], 0.125, 0)


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 16), (torch.bfloat16, 64)])
def test_strided_q_and_out(kernels, dtype, head_dim):
    """q and out may be views into wider rows (e.g. a fused qkv projection)."""
    case = make_case([1, 5, 1], [9, 20, 33], 4, 2, head_dim, dtype, seed=6)
    q = case["q"]
    num_tokens, width = q.shape[0], 4 * head_dim
    wide = torch.randn(num_tokens, 3 * width).to(dtype)
    wide[:, :width] = q.reshape(num_tokens, -1)
    strided_q = wide[:, :width].view(num_tokens, 4, head_dim)  # token stride 3 * width
    out_wide = torch.full((num_tokens, 2 * width), UNTOUCHED, dtype=dtype)
    strided_out = out_wide[:, width:].view(num_tokens, 4, head_dim)
    args = (case["kv_cache"], case["block_tables"], case["query_starts"], case["query_lens"],
            case["seq_lens"], 0.25, 0)
    expected = torch.full_like(q, UNTOUCHED)
    paged_attention_reference(expected, q, *args)
    kernels.paged_attention(strided_out, strided_q, *args)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(strided_out, expected, atol=tol, rtol=tol)
    assert (out_wide[:, :width] == UNTOUCHED).all()


def test_rejects_bad_inputs(kernels):
    case = make_case([1], [20], 4, 2, 16, torch.float32)
    out = torch.empty_like(case["q"])
    args = [out, case["q"], case["kv_cache"], case["block_tables"], case["query_starts"],
            case["query_lens"], case["seq_lens"], 1.0, 0]
    with pytest.raises(RuntimeError, match="int32"):
        kernels.paged_attention(*args[:3], case["block_tables"].long(), *args[4:])
    with pytest.raises(RuntimeError, match="beyond its block table"):
        kernels.paged_attention(*args[:6], torch.tensor([10**4], dtype=torch.int32), *args[7:])
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.paged_attention(out.double(), case["q"].double(), *args[2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (4, 1)])
@pytest.mark.parametrize("head_dim,window", [(64, 0), (16, 0), (128, 0), (64, 40)])
def test_batch_invariant_rows_do_not_depend_on_the_chunking(kernels, dtype, num_heads,
                                                           num_kv_heads, head_dim, window):
    """One prompt of 150 queries (keys over three of the kernel's 64-key chunks) attended
    whole, in chunks of 7 (so tiles of 7 and 2 queries), and one query at a time, beside
    another request: with batch_invariant every row is bitwise the same however its prompt
    was cut (without it, tiles of 4+ rows score transposed keys on AVX-512 and AVX2 builds,
    another summation order; one-query items take the decode loops, and the other tiles of
    bfloat16 read keys through a float32 copy). Head dims the decode loops take (64, 128;
    16 by pairs on AVX512-BF16) and a sliding window."""
    seq_len = 150
    case = make_case([seq_len, 5], [seq_len, 20], num_heads, num_kv_heads, head_dim, dtype)
    q, cache, tables = case["q"], case["kv_cache"], case["block_tables"]
    start = int(case["query_starts"][0])
    prompt_q = q[start:start + seq_len]

    def attend(cuts: list[int]) -> torch.Tensor:
        """The prompt's rows, attended chunk by chunk at `cuts`, each chunk beside request 1."""
        out = torch.empty_like(prompt_q)
        for begin, end in zip([0, *cuts], [*cuts, seq_len]):
            chunk = torch.cat([prompt_q[begin:end], q[:5]])  # then 5 rows of request 1
            chunk_out = torch.zeros_like(chunk)
            as_int = dict(dtype=torch.int32)
            kernels.paged_attention(chunk_out, chunk, cache, tables,
                                    torch.tensor([0, end - begin], **as_int),
                                    torch.tensor([end - begin, 5], **as_int),
                                    torch.tensor([end, 20], **as_int), 0.125, window,
                                    batch_invariant=True)
            out[begin:end] = chunk_out[:end - begin]
        return out

    whole = attend([])
    assert torch.equal(attend(list(range(7, seq_len, 7))), whole)
    assert torch.equal(attend(list(range(1, seq_len))), whole)
