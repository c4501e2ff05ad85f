"""The CUDA platform: the KV cache takes `gpu_memory_utilization` of the card minus what a
profiling forward pass at the largest step peaked at (and what others hold).

Every `torch.cuda` call the start-up makes sits in `TorchCudaMemory`; the arithmetic
around them is `CudaPlatform`'s, which a CPU test drives with stand-in numbers.
"""

from __future__ import annotations

from typing import Protocol

import torch

from carpool.platform.base import Platform


class CudaMemory(Protocol):
    """The memory queries the CUDA start-up makes (bytes)."""

    def total(self) -> int: ...
    def free(self) -> int: ...
    def peak_allocated(self) -> int: ...
    def reserved(self) -> int: ...
    def reset_peak(self) -> None: ...
    def release_cached(self) -> None: ...


class TorchCudaMemory:
    """`CudaMemory` over `torch.cuda` for one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def total(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    def free(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def release_cached(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


class CudaPlatform(Platform):
    profiles_memory = True

    def __init__(self, device: torch.device, memory: CudaMemory | None = None) -> None:
        self.device = device
        self.memory = memory if memory is not None else TorchCudaMemory(device)

    def begin_profile(self) -> None:
        self.memory.reset_peak()

    def end_profile(self) -> None:
        self.memory.release_cached()

    def kv_cache_budget(self, utilization: float) -> int:
        """utilization * card memory - profiled peak - memory held outside this allocator."""
        total, peak = self.memory.total(), self.memory.peak_allocated()
        # Memory outside PyTorch's allocator (other processes, the CUDA context) also counts.
        used_elsewhere = max(total - self.memory.free() - self.memory.reserved(), 0)
        budget = int(total * utilization) - peak - used_elsewhere
        if budget <= 0:
            raise ValueError(f"gpu_memory_utilization ({utilization}) leaves no room for the KV "
                             f"cache: weights and activations peak at {peak} bytes of {total}, "
                             f"{used_elsewhere} bytes are held outside carpool")
        return budget

    def describe(self) -> str:
        return f"cuda ({self.device})"
