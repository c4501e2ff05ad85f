"""The small GEMMs (csrc/gemm/small_gemm.cpp) against their PyTorch reference, called directly
with their packed weights on every build this CPU runs: row counts across the tiles of each
ISA, output widths off the 16-column blocks, bias or none, strided rows, AMX tiles where the
CPU has them, and their checks. (PackedLinear's use of them, and each row's independence of
its batch: tests/platform/test_cpu_linear.py.)"""

from __future__ import annotations

import pytest
import torch

from carpool.kernels.reference import small_gemm_bf16_reference, small_gemm_f32_reference

# Row counts: one row, an AVX2 bfloat16 tile (5), a narrow AVX-512 tile (12) and one more,
# several tiles with a ragged last one.
ROWS = [1, 5, 12, 13, 40]
# (K, N): blocks of 16 columns and a partial last block, one column, a K in 32s (AMX takes it).
SHAPES = [(96, 160), (576, 577), (2, 17), (64, 1)]


def operands(rows: int, k: int, n: int, dtype: torch.dtype, bias: bool, seed: int):
    """x [rows, K] as a view of wider rows (a row stride of K + 8), weight [N, K], bias [N]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k + 8, generator=gen).to(dtype)[:, 4:4 + k]
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    return x, weight, torch.randn(n, generator=gen).to(dtype) if bias else None


@pytest.fixture(scope="module")
def bf16_kernels(kernels):
    if not kernels.has_small_gemm_bf16():
        pytest.skip("no bfloat16 small GEMM in this build on this CPU")
    return kernels


@pytest.fixture(scope="module")
def f32_kernels(kernels):
    if not kernels.has_f32_gemm():
        pytest.skip("no float32 small GEMM in this build")
    return kernels


@pytest.mark.parametrize("amx", [False, True], ids=["vector", "amx"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("k,n", SHAPES, ids=lambda s: str(s))
@pytest.mark.parametrize("rows", ROWS)
def test_small_gemm_bf16_matches_reference(bf16_kernels, rows, k, n, bias, amx):
    """float32 sums rounded once: within a bfloat16 step of the reference's single rounding."""
    if amx and not (bf16_kernels.has_amx() and k % 32 == 0):
        pytest.skip("no AMX in this build and CPU, or a K the tiles do not take")
    x, weight, b = operands(rows, k, n, torch.bfloat16, bias, seed=rows * k + n)
    out = bf16_kernels.small_gemm_bf16(x, bf16_kernels.pack_bf16_weight(weight), n, b, amx=amx)
    expected = small_gemm_bf16_reference(x, weight, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("k,n", [*SHAPES, (3, 17)], ids=lambda s: str(s))
@pytest.mark.parametrize("rows", ROWS)
def test_small_gemm_f32_matches_reference(f32_kernels, rows, k, n, bias):
    x, weight, b = operands(rows, k, n, torch.float32, bias, seed=rows * k + n)
    out = f32_kernels.small_gemm_f32(x, f32_kernels.pack_f32_weight(weight), n, b)
    torch.testing.assert_close(out, small_gemm_f32_reference(x, weight, b), atol=1e-5,
                               rtol=1e-5)


def test_small_gemms_take_no_rows(f32_kernels):
    packed = f32_kernels.pack_f32_weight(torch.randn(17, 8))
    assert f32_kernels.small_gemm_f32(torch.zeros(0, 8), packed, 17).shape == (0, 17)
    if f32_kernels.has_small_gemm_bf16():
        packed = f32_kernels.pack_bf16_weight(torch.randn(17, 8).bfloat16())
        x = torch.zeros(0, 8, dtype=torch.bfloat16)
        assert f32_kernels.small_gemm_bf16(x, packed, 17).shape == (0, 17)


def test_small_gemm_bf16_checks_its_arguments(bf16_kernels):
    packed = bf16_kernels.pack_bf16_weight(torch.randn(8, 6).bfloat16())
    with pytest.raises(RuntimeError, match="K even"):
        bf16_kernels.pack_bf16_weight(torch.randn(8, 5).bfloat16())
    with pytest.raises(RuntimeError, match="does not match"):
        bf16_kernels.small_gemm_bf16(torch.randn(2, 4).bfloat16(), packed, 8)
    with pytest.raises(RuntimeError, match="bfloat16 CPU"):
        bf16_kernels.small_gemm_bf16(torch.randn(2, 6), packed, 8)
    with pytest.raises(RuntimeError, match="bias must be"):
        bf16_kernels.small_gemm_bf16(torch.randn(2, 6).bfloat16(), packed, 8,
                                     torch.zeros(7).bfloat16())
