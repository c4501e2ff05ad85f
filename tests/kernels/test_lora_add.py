"""lora_add_ (csrc/gemm/lora_gemm.cpp) equals its reference: every adapter's rows of one
linear, stacked parts with their own ranks and columns, base rows untouched, float32 and
bfloat16, on every build this CPU runs."""

from __future__ import annotations

import pytest
import torch

from carpool.kernels.reference import lora_add_reference


def case(dtype: torch.dtype, gen: torch.Generator):
    """A step of 11 rows: rows 0-1 base, 2-6 adapter 0 (three parts, ranks 8/8/8, as q/k/v),
    7 base, 8-10 adapter 1 (one part of rank 16 in the middle columns)."""
    rows, in_features, out_features = 11, 72, 80
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    out = torch.randn(rows, out_features, generator=gen).to(dtype)
    a = [torch.randn(in_features, 24, generator=gen).to(dtype),
         torch.randn(in_features, 16, generator=gen).to(dtype)]
    b = [torch.randn(8, 48, generator=gen).to(dtype), torch.randn(8, 16, generator=gen).to(dtype),
         torch.randn(8, 16, generator=gen).to(dtype), torch.randn(16, 40, generator=gen).to(dtype)]
    parts = [0, 0, 0, 8, 0, 48, 8, 16, 0, 64, 16, 24, 1, 20, 0, 16]
    return out, x, [2, 8], [7, 11], a, b, parts


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_lora_add_equals_its_reference(kernels, dtype, tolerance):
    gen = torch.Generator().manual_seed(0)
    out, x, starts, ends, a, b, parts = case(dtype, gen)
    expected = lora_add_reference(out.clone(), x, starts, ends, a, b, parts)
    got = out.clone()
    kernels.lora_add_(got, x, starts, ends, a, b, parts)
    assert torch.equal(got[[0, 1, 7]], out[[0, 1, 7]])  # base rows pay nothing
    assert not torch.equal(got[2:7], out[2:7])
    scale = expected.float().abs().max()
    assert (got.float() - expected.float()).abs().max() <= tolerance * scale


def test_a_row_is_the_same_alone(kernels):
    gen = torch.Generator().manual_seed(1)
    out, x, starts, ends, a, b, parts = case(torch.float32, gen)
    together = out.clone()
    kernels.lora_add_(together, x, starts, ends, a, b, parts)
    alone = out[3:4].clone()
    kernels.lora_add_(alone, x[3:4].contiguous(), [0], [1], a[:1], b[:3], parts[:12])
    assert torch.equal(alone, together[3:4])


def test_bad_arguments_are_refused(kernels):
    gen = torch.Generator().manual_seed(2)
    out, x, starts, ends, a, b, parts = case(torch.float32, gen)
    with pytest.raises(RuntimeError, match="parts"):
        kernels.lora_add_(out, x, starts, ends, a, b, parts[:-1])
    with pytest.raises(RuntimeError, match="rows out of range"):
        kernels.lora_add_(out, x, [2, 8], [7, 12], a, b, parts)
    with pytest.raises(RuntimeError, match="within out and A"):
        kernels.lora_add_(out, x, starts, ends, a, b, parts[:-4] + [1, 60, 0, 16])
