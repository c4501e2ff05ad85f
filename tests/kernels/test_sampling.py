"""argmax_rows (csrc/sampling/greedy.cpp) gives its reference's answers, `max(-1).indices`
(first of equals, first NaN, -inf rows, signed zeros, every row length around the vector
width), on every build this CPU runs."""

from __future__ import annotations

import pytest
import torch

from carpool.kernels.reference import argmax_rows_reference


def _cases(dtype: torch.dtype, rows: int, n: int, gen: torch.Generator):
    x = torch.randn(rows, n, generator=gen).to(dtype)
    yield x
    yield (x * 2).round()  # many equal maxima
    nan = x.clone()
    nan[torch.rand(x.shape, generator=gen) < 0.3] = float("nan")
    yield nan
    yield torch.full_like(x, float("-inf"))
    inf = x.clone()
    inf[:, n // 2] = float("inf")
    inf[:, -1] = float("inf")
    yield inf
    zeros = torch.zeros_like(x)
    zeros[torch.rand(x.shape, generator=gen) < 0.5] = -0.0
    yield zeros
    last = torch.full_like(x, -1.0)
    last[:, -1] = 2.0  # the maximum in the scalar tail
    yield last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 1), (3, 5), (2, 31), (4, 32), (5, 33), (3, 64), (2, 65),
                                    (9, 1000), (40, 4096)])
def test_argmax_rows_matches_reference(kernels, dtype, rows, n):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    for x in _cases(dtype, rows, n, gen):
        assert torch.equal(kernels.argmax_rows(x), argmax_rows_reference(x)), x
        strided = torch.cat([x, x], dim=-1)[:, :n]  # rows apart by more than n
        assert torch.equal(kernels.argmax_rows(strided), argmax_rows_reference(strided))


def test_argmax_rows_refuses_what_it_does_not_take(kernels):
    with pytest.raises(RuntimeError, match="argmax_rows"):
        kernels.argmax_rows(torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="argmax_rows"):
        kernels.argmax_rows(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="argmax_rows"):
        kernels.argmax_rows(torch.zeros(4, 6).t())
