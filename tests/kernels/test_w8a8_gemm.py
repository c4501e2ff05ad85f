"""W8A8's int8 x int8 product (csrc/gemm/w8a8_gemm.cpp) against its PyTorch reference on
every build this CPU runs (AVX-512 VNNI, the AVX2 `vpmaddwd` loop), bit for bit: rows that
fill no tile and rows that leave remainders, K not a multiple of 4 or 64, N not a multiple of
a block of 16 nor of a tile of blocks; and the reference against the fake-quantized product
compressed-tensors describes (the same model, rounded once instead of twice)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from carpool.kernels.reference import int8_per_token_reference, w8a8_linear_reference

DTYPES = [torch.float32, torch.bfloat16]


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def operands(m: int, k: int, n: int, dtype: torch.dtype, seed: int):
    """x with rows of very different magnitudes (a row of zeros, one that saturates at -128
    and 127), an int8 weight over the whole range, per-column scales."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m)[:, None]
    if m > 2:
        x[1] = 0
        x[2, 0], x[2, -1] = -1000.0, 1000.0
    qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, 1, generator=gen) / 256 + 1e-4
    return x.to(dtype), qweight, scales


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(("k", "n"), [(64, 16), (100, 67), (576, 200), (37, 5), (1100, 33)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 64, 65, 300])
def test_w8a8_linear_matches_reference_bitwise(kernels, rows, k, n, dtype):
    x, qweight, scales = operands(rows, k, n, dtype, seed=rows * 7919 + k * 31 + n)
    packed = kernels.pack_w8a8_weight(qweight, scales)
    assert packed.w8a8 and (packed.n, packed.k) == (n, k)
    ours = kernels.w8a8_linear(x, packed)
    assert ours.dtype == dtype and ours.shape == (rows, n)
    assert torch.equal(ours, w8a8_linear_reference(x, qweight, scales))
    # quant_linear, which the platform and the layer stack call, takes the same weight
    assert torch.equal(kernels.quant_linear(x, packed, None), ours)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_w8a8_bias_and_strided_rows(kernels, dtype):
    x, qweight, scales = operands(9, 96, 40, dtype, seed=5)
    bias = torch.randn(40)
    packed = kernels.pack_w8a8_weight(qweight, scales.flatten())
    expected = w8a8_linear_reference(x, qweight, scales, bias)
    assert torch.equal(kernels.w8a8_linear(x, packed, bias), expected)
    strided = torch.cat([x, x], dim=1)[:, :96]  # rows not contiguous with each other
    assert torch.equal(kernels.w8a8_linear(strided, packed, bias), expected)
    assert kernels.w8a8_linear(x[:0], packed).shape == (0, 40)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_a_rows_result_does_not_depend_on_its_batch(kernels, dtype):
    x, qweight, scales = operands(150, 576, 96, dtype, seed=11)
    packed = kernels.pack_w8a8_weight(qweight, scales)
    whole = kernels.w8a8_linear(x, packed)
    for r in (0, 5, 77, 149):
        assert torch.equal(kernels.w8a8_linear(x[r:r + 1], packed), whole[r:r + 1])


def test_w8a8_bad_arguments_name_the_argument(kernels):
    q = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="qweight must be a CPU int8"):
        kernels.pack_w8a8_weight(q.to(torch.uint8), torch.ones(4))
    with pytest.raises(RuntimeError, match="scales must be float32"):
        kernels.pack_w8a8_weight(q, torch.ones(4, 2))
    packed = kernels.pack_w8a8_weight(q, torch.ones(4))
    with pytest.raises(RuntimeError, match="x has K = 7"):
        kernels.w8a8_linear(torch.ones(2, 7), packed)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.w8a8_linear(torch.ones(2, 8, dtype=torch.float16), packed)
    with pytest.raises(RuntimeError, match="W8A8 weight"):
        kernels.dequantize_rows(packed, 0, 4, torch.float32)
    other = kernels.pack_quant_weight(q, torch.ones(4, 1), None, 8, 8)
    with pytest.raises(RuntimeError, match="not packed by pack_w8a8_weight"):
        kernels.w8a8_linear(torch.ones(2, 8), other)


@pytest.mark.parametrize("k", [576, 1100])
def test_reference_is_the_fake_quantized_product_rounded_once(k):
    """(sum q_x q_w) s_x s_w is x' @ W'.T with x' = q_x s_x and W' = q_w s_w (compressed-
    tensors' fake quantization) in exact arithmetic: in float32 the two agree to float32's
    rounding, and the model-level product (`w8a8_product`, the path without kernels) gives
    the reference's bits."""
    from carpool.models.quant.weight import w8a8_product

    x, qweight, scales = operands(20, k, 48, torch.float32, seed=k)
    ours = w8a8_linear_reference(x, qweight, scales)
    fake = F.linear(int8_per_token_reference(x).double(), (qweight.double() * scales.double()))
    torch.testing.assert_close(ours.double(), fake, rtol=1e-5, atol=1e-6)
    assert torch.equal(w8a8_product(x, qweight, scales), ours)
    xb = x.bfloat16()
    assert torch.equal(w8a8_product(xb, qweight, scales),
                       w8a8_linear_reference(xb, qweight, scales))
