"""The quantized GEMM (csrc/gemm/quant_gemm.cpp, quant_pack.cpp) against its PyTorch reference
on every build this CPU runs, and the reference itself against the gguf package's own
dequantization of Q8_0 and Q4_0 (carpool's canonical quantized form: quant_weight.h)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from carpool.kernels.quant_rows import quant_matmul
from carpool.kernels.reference import dequantize_ref, quant_linear_ref

K = 256
N = 67  # odd: a partial last block of 16 columns
# (bits, group_size, mins): int8 in groups of 16 and 32 and per channel (g = K), int4 in 32s
# (Q4_0, Q4_K, AWQ) and 128s (GPTQ), with mins and without; int8 q in -16..15 packed in five
# bits (Q5_0), in -32..31 packed as bits 6 (Q6_K)
FORMATS = [(8, 16, False), (8, 32, True), (8, K, False), (4, 32, True), (4, 128, False),
           (4, 32, False), (8, 16, True), (5, 32, False), (5, 64, True), (6, 16, False),
           (6, 32, True)]
ROWS = [1, 2, 3, 7, 16, 33, 300]


def fmt_id(fmt) -> str:
    bits, group, mins = fmt
    return f"int{bits}-g{group}" + ("-mins" if mins else "")


def canonical(n: int, k: int, bits: int, group: int, mins: bool, seed: int):
    """Random canonical operands: (qweight, scales, mins or None, bits, group_size)."""
    gen = torch.Generator().manual_seed(seed)
    if bits == 5:
        qweight = torch.randint(-16, 16, (n, k), dtype=torch.int8, generator=gen)
    elif bits == 6:
        qweight = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=gen)
    elif bits == 8:
        qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    else:
        qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.rand(n, k // group, generator=gen) / (8 * k ** 0.5)
    offsets = torch.randn(n, k // group, generator=gen) / 16 if mins else None
    return qweight, scales, offsets, bits, group


def reference_args(operands):
    """The canonical weight the reference takes: a five- or six-bit packing's q is the int8
    one."""
    qweight, scales, offsets, bits, group = operands
    return qweight, scales, offsets, 8 if bits in (5, 6) else bits, group


# --- the reference against gguf -------------------------------------------------------------


def blocks_of(data: np.ndarray, n: int, block_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's blocks of 32 weights as (d float32 [n, K / 32], the rest's bytes [n, K / 32, ...])."""
    blocks = data.reshape(n, -1, block_bytes)
    d = blocks[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    return d, blocks[:, :, 2:]


def test_reference_dequantizes_q8_0_as_gguf():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((5, 128)).astype(np.float32)
    data = quantize(weight, GGMLQuantizationType.Q8_0)
    d, q = blocks_of(data, 5, 34)
    qweight = torch.from_numpy(q.copy().view(np.int8).reshape(5, 128))
    ours = dequantize_ref(qweight, torch.from_numpy(d), None, 8, 32)
    theirs = torch.from_numpy(dequantize(data, GGMLQuantizationType.Q8_0))
    assert torch.equal(ours, theirs)


def test_reference_dequantizes_q4_0_as_gguf():
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((5, 128)).astype(np.float32)
    data = quantize(weight, GGMLQuantizationType.Q4_0)
    d, q = blocks_of(data, 5, 18)
    qweight = torch.from_numpy(q.reshape(5, 64).copy())  # the nibbles as ggml stores them
    ours = dequantize_ref(qweight, torch.from_numpy(d), torch.from_numpy(-8 * d), 4, 32)
    theirs = torch.from_numpy(dequantize(data, GGMLQuantizationType.Q4_0))
    assert torch.equal(ours, theirs)


# --- the kernels ----------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
@pytest.mark.parametrize("rows", ROWS)
def test_quant_linear_matches_reference(kernels, rows, fmt, dtype, bias):
    """float32: within 1e-5 of the output's scale (the kernel sums group by group); bfloat16:
    the same float32 sums rounded once, so within one bfloat16 step of the reference."""
    operands = canonical(N, K, *fmt, seed=rows)
    gen = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen) if bias else None
    out = kernels.quant_linear(x, kernels.pack_quant_weight(*operands), b)
    expected = quant_linear_ref(x, *reference_args(operands), b)
    assert out.dtype == dtype and out.shape == (rows, N)
    scale = expected.float().abs().max().item()
    rtol = 0.0 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-5 * scale, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_a_rows_result_does_not_depend_on_its_batch(kernels, fmt, dtype):
    """Row m alone, or in a batch of any size and position, gives the same bits (the tiles
    and threads split the rows and columns, never a row's sum)."""
    packed = kernels.pack_quant_weight(*canonical(N, K, *fmt, seed=7))
    b = torch.randn(N)
    x = torch.randn(300, K).to(dtype)
    full = kernels.quant_linear(x, packed, b)
    for rows in ROWS:
        assert torch.equal(kernels.quant_linear(x[:rows], packed, b), full[:rows]), rows
    for row in (0, 1, 5, 16, 150, 299):
        alone = kernels.quant_linear(x[row:row + 1], packed, b)
        assert torch.equal(alone, full[row:row + 1]), row
        assert torch.equal(kernels.quant_linear(x[row:row + 7], packed, b)[0], full[row]), row


def test_quant_linear_takes_strided_rows_and_no_rows(kernels):
    operands = canonical(N, K, 4, 32, True, seed=3)
    packed = kernels.pack_quant_weight(*operands)
    x = torch.randn(5, K + 8)[:, 4:4 + K]  # a row stride of K + 8
    torch.testing.assert_close(kernels.quant_linear(x, packed), quant_linear_ref(x, *operands),
                               atol=1e-5, rtol=1e-5)
    assert kernels.quant_linear(torch.zeros(0, K), packed).shape == (0, N)


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_dequantize_rows_matches_reference(kernels, fmt):
    """Each weight s * q + m in one fused multiply-add: within a float32 rounding."""
    operands = canonical(N, K, *fmt, seed=11)
    packed = kernels.pack_quant_weight(*operands)
    expected = dequantize_ref(*reference_args(operands))
    for n0, n1 in [(0, N), (5, 40), (16, 32), (66, 67), (3, 3)]:
        rows = kernels.dequantize_rows(packed, n0, n1, torch.float32)
        assert rows.shape == (n1 - n0, K) and rows.dtype == torch.float32
        torch.testing.assert_close(rows, expected[n0:n1], atol=1e-7, rtol=1e-6)
    rows = kernels.dequantize_rows(packed, 0, N, torch.bfloat16)
    torch.testing.assert_close(rows.float(), expected, atol=1e-7, rtol=2 ** -8)


def test_packed_weight_is_no_bigger_than_the_canonical_one(kernels):
    """Whole blocks of 16 columns: exactly the canonical bytes (q, scales, mins); five-bit
    packing holds the int8 q in 5/8 of its bytes."""
    for bits, group, mins in FORMATS:
        qweight, scales, offsets, _, _ = canonical(64, K, bits, group, mins, seed=0)
        packed = kernels.pack_quant_weight(qweight, scales, offsets, bits, group)
        q_bytes = qweight.nbytes * 5 // 8 if bits == 5 else qweight.nbytes
        canonical_bytes = q_bytes + scales.nbytes * (2 if mins else 1)
        assert packed.nbytes == canonical_bytes, (bits, group, mins)
        assert (packed.n, packed.k, packed.bits, packed.group_size, packed.has_mins) == (
            64, K, bits, group, mins)


def test_bad_arguments_name_the_argument(kernels):
    qweight, scales, offsets, _, _ = canonical(N, K, 8, 32, True, seed=0)
    pack = kernels.pack_quant_weight
    with pytest.raises(RuntimeError, match="bits must be 8, 6, 5 or 4, got 3"):
        pack(qweight, scales, offsets, 3, 32)
    with pytest.raises(RuntimeError, match="bits 5 takes q in -16..15 only"):
        pack(qweight, scales, offsets, 5, 32)
    with pytest.raises(RuntimeError, match="bits 6 takes q in -32..31 only"):
        pack(qweight, scales, offsets, 6, 32)
    with pytest.raises(RuntimeError, match="group_size must be even for bits 6"):
        pack(qweight.clamp(-32, 31), torch.rand(N, K), None, 6, 1)
    with pytest.raises(RuntimeError, match="group_size .48. must divide K .256."):
        pack(qweight, torch.rand(N, 5), None, 8, 48)
    with pytest.raises(RuntimeError, match="qweight must be a CPU int8"):
        pack(qweight.to(torch.int16), scales, None, 8, 32)
    with pytest.raises(RuntimeError, match="qweight must be a CPU uint8"):
        pack(qweight, scales, None, 4, 32)
    with pytest.raises(RuntimeError, match="group_size must be a multiple of 32 for bits 4"):
        pack(torch.zeros(N, K // 2, dtype=torch.uint8), torch.rand(N, 16), None, 4, 16)
    with pytest.raises(RuntimeError, match="scales must be float32"):
        pack(qweight, scales.double(), None, 8, 32)
    with pytest.raises(RuntimeError, match="mins must be float32 .N, K / group_size."):
        pack(qweight, scales, offsets[:, :3], 8, 32)
    packed = pack(qweight, scales, offsets, 8, 32)
    with pytest.raises(RuntimeError, match="x must be a float32 or bfloat16"):
        kernels.quant_linear(torch.zeros(1, K, dtype=torch.float16), packed)
    with pytest.raises(RuntimeError, match="x has K = 255 columns, the packed weight K = 256"):
        kernels.quant_linear(torch.zeros(1, K - 1), packed)
    with pytest.raises(RuntimeError, match="bias must be a floating .N. = .67."):
        kernels.quant_linear(torch.zeros(1, K), packed, torch.zeros(N + 1))
    with pytest.raises(RuntimeError, match="dequantize_rows: rows .n0, n1."):
        kernels.dequantize_rows(packed, 10, N + 1, torch.float32)
    with pytest.raises(RuntimeError, match="dequantize_rows: dtype must be"):
        kernels.dequantize_rows(packed, 0, N, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_six_bit_packing_gives_the_eight_bit_packings_bits(kernels, dtype):
    """Q6_K's q (-32..31) packed as bits 6 (pairs, a table lookup) sums the same products in
    the same order as bits 8: the same bits at every row count and path, rounded included."""
    qweight, scales, offsets, _, group = canonical(N, K, 6, 16, True, seed=11)
    six = kernels.pack_quant_weight(qweight, scales, offsets, 6, group)
    eight = kernels.pack_quant_weight(qweight, scales, offsets, 8, group)
    assert six.nbytes == eight.nbytes
    for rows in (1, 2, 3, 300):
        x = torch.randn(rows, K).to(dtype)
        assert torch.equal(kernels.quant_linear(x, six), kernels.quant_linear(x, eight)), rows
        if dtype == torch.bfloat16:
            assert torch.equal(kernels.quant_linear(x, six, None, 1),
                               kernels.quant_linear(x, eight, None, 1)), rows
    assert torch.equal(kernels.dequantize_rows(six, 3, 40, torch.float32),
                       kernels.dequantize_rows(eight, 3, 40, torch.float32))


def test_reference_rejects_other_bits():
    with pytest.raises(ValueError, match="bits must be 8 or 4, got 3"):
        dequantize_ref(torch.zeros(2, 32, dtype=torch.int8), torch.ones(2, 1), None, 3, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_quant_matmul_takes_the_kernel_up_to_the_cut_and_onednn_above(kernels, dtype):
    """Up to the cut, quant_linear's bits; above it the reference, in bfloat16 within a bfloat16
    step of the output's scale (the weight is dequantized to bfloat16 first: each weight within
    2^-9 of its value)."""
    operands = canonical(N, K, 4, 32, True, seed=5)
    packed = kernels.pack_quant_weight(*operands)
    b = torch.randn(N)
    for rows in (1, 8, 9, 40):
        x = torch.randn(rows, K).to(dtype)
        out = quant_matmul(kernels, x, packed, b, max_rows=8)
        if rows <= 8:
            assert torch.equal(out, kernels.quant_linear(x, packed, b))
        expected = quant_linear_ref(x, *reference_args(operands), b)
        scale = expected.float().abs().max().item()
        if dtype == torch.float32:
            atol, rtol = 1e-5 * scale, 1e-5
        else:  # the output's rounding; above the cut, the weight's too
            atol, rtol = (1e-5 if rows <= 8 else 2 ** -7) * scale, 2 ** -7
        torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_odd_groups_and_thread_counts(kernels, dtype):
    """An odd group (per channel of an odd K: no whole bfloat16 pairs, so the float32 loop)
    matches the reference; and the threads split columns only, so their number changes no
    bit."""
    operands = canonical(N, 125, 8, 125, True, seed=13)
    x = torch.randn(9, 125).to(dtype)
    packed = kernels.pack_quant_weight(*operands)
    out = kernels.quant_linear(x, packed)
    expected = quant_linear_ref(x, *operands)
    scale = expected.float().abs().max().item()
    rtol = 0.0 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-5 * scale, rtol=rtol)
    assert torch.equal(kernels.quant_linear(x[4:5], packed), out[4:5])
    packed = kernels.pack_quant_weight(*canonical(N, K, 4, 32, True, seed=14))
    x = torch.randn(20, K).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.quant_linear(x, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(kernels.quant_linear(x, packed), one)


# --- float16 group headers -----------------------------------------------------------------

F16_FORMATS = [(8, 32, False), (5, 32, False), (4, 32, True), (8, 16, True)]


def f16_exact(operands):
    """The operands with scales and mins rounded to float16, as GGUF's Q8_0 / Q5_0 / Q4_0
    store them."""
    qweight, scales, offsets, bits, group = operands
    def rounded(t):
        return None if t is None else t.half().float()
    return qweight, rounded(scales), rounded(offsets), bits, group


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt", F16_FORMATS, ids=fmt_id)
def test_f16_headers_give_the_same_bits_in_fewer_bytes(kernels, fmt, dtype):
    """Scales and mins exact in float16 packed as float16: every result the same bits as the
    float32 header's, the packed weight smaller by half its header."""
    operands = f16_exact(canonical(N, K, *fmt, seed=13))
    wide = kernels.pack_quant_weight(*operands)
    narrow = kernels.pack_quant_weight(*operands, f16_header=True)
    assert narrow.f16_header and not wide.f16_header
    groups = (N + 15) // 16 * 16 * (K // fmt[1])
    assert wide.nbytes - narrow.nbytes == groups * 2 * (2 if fmt[2] else 1)
    b = torch.randn(N)
    for rows in (1, 2, 7, 300):
        x = torch.randn(rows, K).to(dtype)
        assert torch.equal(kernels.quant_linear(x, narrow, b), kernels.quant_linear(x, wide, b))
    for out in (torch.float32, torch.bfloat16):
        assert torch.equal(kernels.dequantize_rows(narrow, 3, N, out),
                           kernels.dequantize_rows(wide, 3, N, out))


def test_f16_headers_refuse_scales_float16_cannot_hold(kernels):
    operands = canonical(N, K, 8, 32, False, seed=0)  # float32 scales, not float16's
    with pytest.raises(RuntimeError, match="f16_header needs every scale and min exact"):
        kernels.pack_quant_weight(*operands, f16_header=True)


# --- the weight rounded to bfloat16, for many rows ----------------------------------------------


def takes_rounded_path(kernels) -> bool:
    """The rounded path needs AVX512-BF16 and the AVX-512 build (the others run exact rows)."""
    from carpool.kernels import cpu_flags
    return (kernels.__name__.find("avx512") >= 0 and "avx512_bf16" in cpu_flags())


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
@pytest.mark.parametrize("rows", [3, 7, 64, 200])
def test_rounded_rows_multiply_by_the_weight_rounded_to_bfloat16(kernels, fmt, rows):
    """From `rounded_from` bfloat16 rows on, the product is x @ bf16(W).T in float32 sums,
    rounded once: the reference on the dequantized weight rounded to bfloat16. Below it, and
    on builds without AVX512-BF16, the exact path's bits."""
    operands = canonical(N, K, *fmt, seed=17)
    packed = kernels.pack_quant_weight(*operands)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, K, generator=gen).to(torch.bfloat16)
    b = torch.randn(N, generator=gen)
    exact = kernels.quant_linear(x, packed, b)
    assert torch.equal(kernels.quant_linear(x, packed, b, rows + 1), exact)
    got = kernels.quant_linear(x, packed, b, rows)
    if not takes_rounded_path(kernels):
        assert torch.equal(got, exact)
        return
    weight = dequantize_ref(*reference_args(operands)).bfloat16().float()
    expected = (x.float() @ weight.T + b).bfloat16()
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-5 * scale, rtol=2 ** -7)
    assert not torch.equal(got, exact)  # the weight's rounding shows in some output
