"""The CPU platform: malloc tuning and pinned threads for the process, oneDNN-packed
linears and the C++ kernels for the model, and a modest share of RAM for the KV cache.
The KV cache goes on transparent huge pages (`cpu_huge_pages`). Each is a config switch
(`cpu_malloc_tuning`, `cpu_kv_huge_pages`, `cpu_omp_threads_bind`, `cpu_packed_linears`,
`cpu_kernels`), on by default because each helps here (threads are pinned by default only
in the processes carpool starts, see `utils/cpu_threads`). The C++ kernels (paged
attention, the KV write, fused RoPE, residual add + RMSNorm, SiLU x up) are built on first
use; without a compiler the PyTorch paths run, after one warning line. With them, the
steps whose linears all take the small GEMM run the decoder layers in one C++ call
(`cpu_layer_stack`).

`batch_invariant` (off by default) makes every linear, packed or not, multiply only a few
fixed row counts per call (`cpu_invariant_linear`), so a row's result never depends on how
many rows its step has."""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from carpool.models.llama import RMSNorm, SiluAndMul
from carpool.models.rope import Rotary
from carpool.platform.base import Platform
from carpool.platform.cpu_fused import FusedRMSNorm, FusedRotary, FusedSiluAndMul
from carpool.platform.cpu_huge_pages import zeros_on_huge_pages
from carpool.platform.cpu_invariant_linear import tile_linears
from carpool.platform.cpu_layer_stack import KernelLayerStack
from carpool.platform.cpu_linear import can_pack, pack_linears
from carpool.platform.cpu_memory import keep_freed_memory_in_heap
from carpool.utils.cpu_threads import NO_BIND, bind_threads

CPU_DEFAULT_FRACTION = 0.10  # of available RAM
CPU_DEFAULT_MAX_BYTES = 4 * 1024**3


@dataclass(frozen=True)
class CpuPlatform(Platform):
    packed_linears: bool = True
    malloc_tuning: bool = True
    kv_huge_pages: bool = True
    kernels: bool = True
    batch_invariant: bool = False
    omp_threads_bind: str = NO_BIND  # see cpu_threads
    thread_slot: int = 0  # this process's slot in omp_threads_bind
    # The step token budget: a linear called on exactly that many rows (a full prefill
    # step) runs as one oneDNN call (`cpu_linear.PackedLinear`); 0: none.
    full_step_rows: int = 0

    def prepare_process(self) -> None:
        if self.malloc_tuning:
            keep_freed_memory_in_heap()
        bind_threads(self.omp_threads_bind, self.thread_slot, self.compiled_kernels())

    def prepare_model(self, model: nn.Module) -> None:
        kernels = self.compiled_kernels()
        if self.packed_linears and can_pack(model):
            if self.batch_invariant:  # tile_linears fixes the row counts instead
                pack_linears(model)
            else:
                pack_linears(model, kernels, self.full_step_rows)
        if self.batch_invariant:
            tile_linears(model)
        if kernels is not None:
            fused = {Rotary: lambda _: FusedRotary(kernels),
                     SiluAndMul: lambda _: FusedSiluAndMul(kernels),
                     RMSNorm: lambda norm: FusedRMSNorm(norm, kernels)}
            for module in list(model.modules()):
                for name, child in module.named_children():
                    if type(child) in fused:
                        setattr(module, name, fused[type(child)](child))
            if hasattr(model, "layer_stack") and not self.batch_invariant:
                model.layer_stack = KernelLayerStack.of(model, kernels)

    def compiled_kernels(self) -> ModuleType | None:
        if not self.kernels:
            return None
        from carpool import kernels  # builds once per process, then cached
        return kernels.load()

    def kv_cache_zeros(self, shape: tuple[int, ...], dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
        if self.kv_huge_pages:
            return zeros_on_huge_pages(shape, dtype)
        return super().kv_cache_zeros(shape, dtype, device)

    def default_kv_cache_bytes(self) -> int:
        """min(10% of available RAM, 4 GiB)."""
        return min(int(available_ram_bytes() * CPU_DEFAULT_FRACTION), CPU_DEFAULT_MAX_BYTES)

    def describe(self) -> str:
        def state(on: bool) -> str:
            return "on" if on else "off"
        kernels = self.kernels and self.compiled_kernels() is not None
        return (f"cpu (oneDNN-packed linears {state(self.packed_linears)}, malloc tuning "
                f"{state(self.malloc_tuning)}, KV cache huge pages {state(self.kv_huge_pages)}, "
                f"C++ kernels {state(kernels)}, batch-invariant "
                f"{state(self.batch_invariant)})")


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo, else total physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
