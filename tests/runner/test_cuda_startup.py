"""The CUDA start-up path, run on CPU with only the `torch.cuda` memory queries stood in for.

A `CudaPlatform` over `FakeCudaMemory` makes the runner take every line a GPU
start-up takes: the profiling forward at the largest steps the scheduler may send
(through the sdpa backend, what CUDA runs), the `gpu_memory_utilization` budget,
the block count, the KV allocation and the start-up log line.
"""

from __future__ import annotations

import logging

import pytest
import torch

from carpool.cpu_options import CpuOptions
from carpool.models.llama import LlamaForCausalLM
from carpool.platform import CudaPlatform, TorchCudaMemory, platform_for

GiB = 2**30


class FakeCudaMemory:
    """A card of `total` bytes; `held_elsewhere` used by other processes; a fixed peak."""

    def __init__(self, total=8 * GiB, peak=1 * GiB, reserved=1 * GiB, held_elsewhere=GiB // 2):
        self.total_bytes, self.peak, self.reserved_bytes = total, peak, reserved
        self.held_elsewhere = held_elsewhere
        self.calls: list[str] = []

    def total(self) -> int:
        return self.total_bytes

    def free(self) -> int:
        return self.total_bytes - self.reserved_bytes - self.held_elsewhere

    def peak_allocated(self) -> int:
        return self.peak

    def reserved(self) -> int:
        return self.reserved_bytes

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")

    def release_cached(self) -> None:
        self.calls.append("release_cached")


@pytest.fixture
def forward_sizes(monkeypatch):
    """Packed token counts of every model forward, in order."""
    sizes = []
    original = LlamaForCausalLM.forward

    def recording(self, input_ids, *args, **kwargs):
        sizes.append(input_ids.shape[0])
        return original(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", recording)
    return sizes


def test_cuda_sizing_profiles_then_budgets(llama_checkpoint, make_runner, forward_sizes, caplog):
    memory = FakeCudaMemory()
    with caplog.at_level(logging.INFO):
        runner = make_runner(llama_checkpoint, num_kv_blocks=None, gpu_memory_utilization=0.5,
                             attention_backend="sdpa", max_num_batched_tokens=256,
                             max_num_seqs=8, max_model_len=512,
                             platform=CudaPlatform(torch.device("cpu"), memory))
    # The profiling pass: one full-budget prefill step, then max_num_seqs decodes.
    assert forward_sizes == [256, 8]
    assert memory.calls == ["reset_peak", "release_cached"]
    # 0.5 * 8 GiB - 1 GiB peak - 0.5 GiB held by others = 2.5 GiB for the cache.
    budget = 4 * GiB - GiB - GiB // 2
    assert runner.num_kv_blocks == budget // runner._spec.bytes_per_block
    assert runner.kv_caches[0].shape[2] == runner.num_kv_blocks + 1  # + the scratch block
    assert runner.kv_cache_info["num_blocks"] == runner.num_kv_blocks
    assert "attention backend: sdpa; platform: cuda" in caplog.text
    assert f"KV cache: {runner.num_kv_blocks} blocks" in caplog.text


def test_cuda_runner_steps_after_profiling(llama_checkpoint, make_runner, prompts):
    from runner_driver import Driver, DriverRequest

    from carpool.sampling_params import SamplingParams

    def run(**kwargs):
        params = SamplingParams(temperature=0.0, max_tokens=6)
        requests = [DriverRequest(f"r{i}", p, params, arrival_step=i)
                    for i, p in enumerate(prompts)]
        return Driver(make_runner(llama_checkpoint, **kwargs), chunk=16).run(requests)

    # Sized by profiling (small budget: a few hundred blocks), then the same tokens as CPU.
    memory = FakeCudaMemory(total=2**24, peak=2**22, reserved=2**22, held_elsewhere=0)
    cuda_like = run(num_kv_blocks=None, gpu_memory_utilization=0.9, attention_backend="sdpa",
                    platform=CudaPlatform(torch.device("cpu"), memory))
    assert cuda_like == run()


def test_budget_that_leaves_no_room_names_the_setting(llama_checkpoint, make_runner):
    memory = FakeCudaMemory(total=4 * GiB, peak=3 * GiB)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        make_runner(llama_checkpoint, num_kv_blocks=None, gpu_memory_utilization=0.5,
                    platform=CudaPlatform(torch.device("cpu"), memory))


def test_explicit_sizes_skip_profiling(llama_checkpoint, make_runner, forward_sizes):
    memory = FakeCudaMemory()
    runner = make_runner(llama_checkpoint, num_kv_blocks=None, kv_cache_memory=2**20,
                         platform=CudaPlatform(torch.device("cpu"), memory))
    assert runner.num_kv_blocks == 2**20 // runner._spec.bytes_per_block
    assert forward_sizes == [] and memory.calls == []


def test_device_picks_its_platform():
    cuda = platform_for(torch.device("cuda", 0))
    assert isinstance(cuda, CudaPlatform) and isinstance(cuda.memory, TorchCudaMemory)
    assert cuda.profiles_memory and cuda.describe() == "cuda (cuda:0)"
    cpu = platform_for(torch.device("cpu"), CpuOptions(packed_linears=False))
    assert not cpu.profiles_memory and not cpu.packed_linears and cpu.malloc_tuning


def test_profiling_steps_cover_the_largest_step():
    from carpool.runner.model_runner import profiling_steps

    num_blocks, (prefill, decode) = profiling_steps(1000, 64, 300, 16)
    assert prefill.num_scheduled_tokens == 1000 and len(prefill.scheduled) == 4
    assert all(len(s.token_ids) <= 300 for s in prefill.scheduled)
    assert len(decode.scheduled) == 64
    assert all(s.num_computed_tokens == 299 for s in decode.scheduled)
    assert num_blocks == sum(len(s.block_ids) for s in prefill.scheduled)
