"""The runner's sampler takes the compiled greedy argmax exactly when the kernels are on, and
gets `greedy_ids`' answers either way (the kernel itself: tests/kernels/test_sampling.py)."""

from __future__ import annotations

import pytest
import torch

from carpool import kernels as cpu_kernels
from carpool.runner.sampler import greedy_ids


@pytest.mark.parametrize("cpu_kernels_on", [True, False])
def test_runner_sampler_takes_the_kernel_with_the_kernels(llama_checkpoint, make_runner,
                                                          cpu_kernels_on):
    runner = make_runner(llama_checkpoint, cpu_kernels=cpu_kernels_on)
    built = cpu_kernels.load() is not None  # without a build: the PyTorch path either way
    assert (runner.sampler._argmax_rows is not None) == (cpu_kernels_on and built)
    logits = torch.randn(6, 512)
    logits[2, 7] = float("nan")
    assert torch.equal(runner.sampler._greedy_ids(logits), greedy_ids(logits))
    assert torch.equal(runner.sampler._greedy_ids(logits.bfloat16()),
                       greedy_ids(logits.bfloat16()))
