"""The compiled greedy argmax gives `max(-1).indices`' answers (first of equals, first NaN,
-inf rows, signed zeros, every row length around the vector width), and the runner's sampler
takes it exactly when the kernels are on."""

from __future__ import annotations

import pytest
import torch

from carpool import kernels as cpu_kernels
from carpool.runner.sampler import greedy_ids


@pytest.fixture(scope="module")
def kernels():
    module = cpu_kernels.load()
    assert module is not None, "the C++ kernels did not build"
    return module


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
def test_argmax_rows_equals_max_indices(kernels, dtype, rows, n):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    for x in _cases(dtype, rows, n, gen):
        assert torch.equal(kernels.argmax_rows(x), x.max(dim=-1).indices), x
        strided = torch.cat([x, x], dim=-1)[:, :n]  # rows apart by more than n
        assert torch.equal(kernels.argmax_rows(strided), greedy_ids(strided))


def test_argmax_rows_refuses_what_it_does_not_take(kernels):
    with pytest.raises(RuntimeError, match="argmax_rows"):
        kernels.argmax_rows(torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="argmax_rows"):
        kernels.argmax_rows(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="argmax_rows"):
        kernels.argmax_rows(torch.zeros(4, 6).t())


@pytest.mark.parametrize("cpu_kernels_on", [True, False])
def test_runner_sampler_takes_the_kernel_with_the_kernels(llama_checkpoint, make_runner,
                                                          cpu_kernels_on):
    runner = make_runner(llama_checkpoint, cpu_kernels=cpu_kernels_on)
    assert (runner.sampler._argmax_rows is not None) == cpu_kernels_on
    logits = torch.randn(6, 512)
    logits[2, 7] = float("nan")
    assert torch.equal(runner.sampler._greedy_ids(logits), greedy_ids(logits))
    assert torch.equal(runner.sampler._greedy_ids(logits.bfloat16()),
                       greedy_ids(logits.bfloat16()))
