"""The same runner code on CUDA gives the CPU reference's greedy tokens (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from runner_driver import Driver, DriverRequest
from carpool.sampling_params import SamplingParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_greedy_equals_cpu(arch, make_checkpoint, make_runner, prompts):
    path = make_checkpoint(arch, initializer_range=0.2)

    def run(device, **kwargs):
        params = SamplingParams(temperature=0.0, max_tokens=10)
        requests = [DriverRequest(f"r{i}", p, params, arrival_step=i) for i, p in enumerate(prompts)]
        return Driver(make_runner(path, device=device, **kwargs), chunk=16).run(requests)

    assert run("cuda") == run("cpu")


def test_cuda_sizing_from_memory_utilization(llama_checkpoint, make_runner):
    runner = make_runner(llama_checkpoint, device="cuda", num_kv_blocks=None,
                         gpu_memory_utilization=0.05)
    assert runner.num_kv_blocks > 0
    assert runner.kv_caches[0].device.type == "cuda"


def test_cuda_bfloat16_seeded_sampling_runs(make_checkpoint, make_runner, prompts):
    path = make_checkpoint("qwen2", dtype="bfloat16")
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=5, max_tokens=8)
    first = Driver(make_runner(path, device="cuda")).run([DriverRequest("a", prompts[0], params)])
    again = Driver(make_runner(path, device="cuda")).run([DriverRequest("a", prompts[0], params)])
    assert first == again
