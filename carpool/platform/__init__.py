"""What differs between devices outside attention: process set-up, model preparation,
and how much memory the KV cache may take.

`platform_for(device, cpu_options, ...)` picks the `CpuPlatform` or the `CudaPlatform`. The
runner asks its platform and never tests `device.type` itself, so a CPU test can
hand it a `CudaPlatform` over stand-in memory queries and run every line of the
CUDA start-up path except the `torch.cuda` calls.
"""

from __future__ import annotations

import torch

from carpool.cpu_options import CpuOptions
from carpool.platform.base import Platform
from carpool.platform.cpu import CpuPlatform
from carpool.platform.cuda import CudaMemory, CudaPlatform, TorchCudaMemory

__all__ = ["CpuPlatform", "CudaMemory", "CudaPlatform", "Platform", "TorchCudaMemory",
           "platform_for"]


def platform_for(device: torch.device, cpu: CpuOptions | None = None, *,
                 batch_invariant: bool = False, thread_slot: int = 0,
                 max_num_batched_tokens: int = 0, mixture_of_experts: bool = False) -> Platform:
    """The platform of `device`, with the CPU switches `cpu` (default: `CpuOptions()`) applied
    where they matter. thread_slot: this process's slot in `cpu.omp_threads_bind` (see
    carpool.utils.cpu_threads); max_num_batched_tokens: the step budget, whose full steps the
    CPU's linears run as one call each (0: not known); mixture_of_experts: the model's
    sparse layers route rows to experts (the CPU route's `MoeRoute`)."""
    if device.type == "cuda":
        return CudaPlatform(device)
    cpu = CpuOptions() if cpu is None else cpu
    return CpuPlatform(packed_linears=cpu.packed_linears, malloc_tuning=cpu.malloc_tuning,
                       kv_huge_pages=cpu.kv_huge_pages, kernels=cpu.kernels,
                       batch_invariant=batch_invariant, omp_threads_bind=cpu.omp_threads_bind,
                       thread_slot=thread_slot, full_step_rows=max_num_batched_tokens,
                       mixture_of_experts=mixture_of_experts)
