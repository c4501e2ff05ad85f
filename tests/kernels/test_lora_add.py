"""lora_add_ (csrc/gemm/lora_gemm.cpp) equals its reference: every adapter's rows of one
linear, stacked parts with their own ranks and columns, base rows untouched, float32 and
bfloat16, on every build this CPU runs (AVX-512 and AVX2 tiles), in shapes that fill its
row and rank tiles and leave every kind of remainder."""

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


def many_rows_case(dtype: torch.dtype, gen: torch.Generator, rank: int, in_features: int,
                   out_features: int):
    """Rows 0-2 base, then adapters of 1, 0, 7, 25 and 13 rows (one A of `rank` per part, as
    q/k/v: parts of half, a quarter and the rest of out_features), one with a single part of rank
    2 * rank over every column."""
    sizes = [1, 0, 7, 25, 13]
    starts, ends, row = [], [], 3
    for size in sizes:
        starts.append(row)
        ends.append(row + size)
        row += size
    x = torch.randn(row, in_features, generator=gen).to(dtype)
    out = torch.randn(row, out_features, generator=gen).to(dtype)
    widths = [out_features // 2, out_features // 4]
    widths.append(out_features - sum(widths))
    a, b, parts = [], [], []
    for g in range(len(sizes)):
        if g == 3:
            a.append(torch.randn(in_features, 2 * rank, generator=gen).to(dtype))
            b.append(torch.randn(2 * rank, out_features, generator=gen).to(dtype))
            parts += [g, 0, 0, 2 * rank]
            continue
        a.append(torch.randn(in_features, 3 * rank, generator=gen).to(dtype))
        col = 0
        for i, width in enumerate(widths):
            b.append(torch.randn(rank, width, generator=gen).to(dtype))
            parts += [g, col, i * rank, (i + 1) * rank]
            col += width
    return out, x, starts, ends, a, b, parts


@pytest.mark.parametrize("rank, in_features, out_features",
                         [(16, 64, 96), (8, 40, 72), (5, 33, 50), (64, 24, 200), (1, 3, 17)])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_tiles_and_remainders_equal_the_reference(kernels, rank, in_features, out_features,
                                                  dtype, tolerance):
    gen = torch.Generator().manual_seed(rank)
    out, x, starts, ends, a, b, parts = many_rows_case(dtype, gen, rank, in_features,
                                                       out_features)
    expected = lora_add_reference(out.clone(), x, starts, ends, a, b, parts)
    got = out.clone()
    kernels.lora_add_(got, x, starts, ends, a, b, parts)
    assert torch.equal(got[:3], out[:3])
    scale = expected.float().abs().max()
    assert (got.float() - expected.float()).abs().max() <= tolerance * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_in_any_tile(kernels, dtype):
    """Each row of a 25-row adapter computed alone gives the bits it got among the others
    (the tiles only decide which rows share a load of A and B)."""
    gen = torch.Generator().manual_seed(3)
    out, x, starts, ends, a, b, parts = many_rows_case(dtype, gen, 8, 40, 72)
    together = out.clone()
    kernels.lora_add_(together, x, starts, ends, a, b, parts)
    mine = [p for p in range(len(b)) if parts[4 * p] == 3]
    alone_parts = [v for p in mine for v in [0, *parts[4 * p + 1:4 * p + 4]]]
    for row in range(starts[3], ends[3]):
        alone = out[row:row + 1].clone()
        kernels.lora_add_(alone, x[row:row + 1].contiguous(), [0], [1], a[3:4],
                          [b[p] for p in mine], alone_parts)
        assert torch.equal(alone, together[row:row + 1])


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
