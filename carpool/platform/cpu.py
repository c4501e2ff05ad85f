"""The CPU platform: malloc tuning and pinned threads for the process, oneDNN-packed
linears and the C++ kernels for the model, and a modest share of RAM for the KV cache.
The KV cache goes on transparent huge pages (`cpu_huge_pages`). Each is a config switch
(`cpu_malloc_tuning`, `cpu_kv_huge_pages`, `cpu_omp_threads_bind`, `cpu_packed_linears`,
`cpu_kernels`), on by default because each helps here (threads are pinned by default only
in the processes carpool starts, see `utils/cpu_threads`). The C++ kernels (paged
attention, the KV write, fused RoPE, residual add + RMSNorm, SiLU x up, the small GEMMs, the
layer stack) are built on first use; without a compiler the PyTorch paths run, after one
warning line.

Which of them a step runs is decided once, at load, by `cpu_route.decide_route` from this
CPU, the model's dtype and attention shape, the kernels and these switches: the platform logs
the route, shows it in `describe()`, and hands each part to what it picks (`prepare_model`:
linears, fused modules, the layer stack; `attention_backend`: the attention paths).

`batch_invariant` (off by default) makes every linear take the vector small GEMM, whose
rows are independent, or else multiply only a few fixed row counts per call
(`cpu_invariant_linear`), so a row's result never depends on how many rows its step has."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

from carpool.attention import (
    AttentionBackend,
    AttentionShape,
    create_backend,
    resolve_backend_name,
)
from carpool.models.llama import RMSNorm, SiluAndMul
from carpool.models.rope import Rotary
from carpool.platform.base import Platform
from carpool.platform.cpu_fused import FusedRMSNorm, FusedRotary, FusedSiluAndMul
from carpool.platform.cpu_huge_pages import zeros_on_huge_pages
from carpool.platform.cpu_invariant_linear import tile_linears
from carpool.platform.cpu_layer_stack import KernelLayerStack
from carpool.platform.cpu_linear import pack_linears
from carpool.platform.cpu_memory import keep_freed_memory_in_heap, release_free_heap
from carpool.platform.cpu_moe import fuse_experts
from carpool.platform.cpu_quant import (
    QuantLinearPacker,
    describe_quantized,
    prepare_quant_linears,
)
from carpool.platform.cpu_route import CpuFacts, CpuRoute, KernelFacts, decide_route
from carpool.utils.cpu_threads import NO_BIND, bind_threads

logger = logging.getLogger(__name__)

CPU_DEFAULT_FRACTION = 0.10  # of available RAM
CPU_DEFAULT_MAX_BYTES = 4 * 1024**3


class DecidedRoute:
    """The platform's route, set once (its switches are frozen; the route needs the model)."""

    route: CpuRoute | None = None
    packer: QuantLinearPacker | None = None  # handed to the loader (`quant_linear_packer`)

    def keep(self, route: CpuRoute) -> CpuRoute:
        """`route`, kept and logged if it is the first; the kept one if it equals it (a second
        model of the same dtype and shape); ValueError for a different one."""
        if self.route is None:
            self.route = route
            logger.info("CPU route: %s", route.describe())
        elif route != self.route:
            raise ValueError(f"this CpuPlatform already runs the route {self.route.describe()}; "
                             f"a model needing {route.describe()} needs a platform of its own")
        return self.route


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
    mixture_of_experts: bool = False  # the model routes rows to experts (`CpuRoute.moe`)
    _decided: DecidedRoute = field(default_factory=DecidedRoute, init=False, repr=False,
                                   compare=False)

    @property
    def route(self) -> CpuRoute | None:
        """The route this platform decided (None before the first backend or model)."""
        return self._decided.route

    def decide_route(self, dtype: torch.dtype, head_dim: int, sliding_window: int | None,
                     attention_backend: str = "cpu",
                     mixture_of_experts: bool = False) -> CpuRoute:
        """The route of a `dtype` model of `head_dim` (`cpu_route.decide_route`), decided and
        logged once: a second call gets the same route or a ValueError."""
        kernels = self.compiled_kernels()
        facts = None if kernels is None else KernelFacts.of(kernels, head_dim)
        return self._decided.keep(decide_route(
            CpuFacts.probe(), dtype, head_dim, sliding_window, facts,
            packed_linears=self.packed_linears, batch_invariant=self.batch_invariant,
            full_step_rows=self.full_step_rows, attention_backend=attention_backend,
            mixture_of_experts=self.mixture_of_experts or mixture_of_experts))

    def prepare_process(self) -> None:
        if self.malloc_tuning:
            keep_freed_memory_in_heap()
        bind_threads(self.omp_threads_bind, self.thread_slot, self.compiled_kernels())

    def attention_backend(self, name: str, shape: AttentionShape,
                          device: torch.device) -> AttentionBackend:
        """The backend `name` resolves to on this route (the route is decided here when the
        runner asks for its backend before its model)."""
        route = self.decide_route(shape.dtype, shape.head_dim, shape.sliding_window,
                                  resolve_backend_name(name, device.type))
        return create_backend(name, shape, device, self.compiled_kernels(),
                              route=route.attention)

    def prepare_model(self, model: nn.Module) -> None:
        """Rewrite `model` as the route says: linears packed (their small-GEMM cut) or tiled,
        the fused elementwise modules, the C++ layer stack."""
        config = model.config
        backend = "sdpa" if self.route and self.route.attention.backend == "sdpa" else "cpu"
        route = self.decide_route(model_dtype(model), config.head_dim,
                                  config.sliding_window, backend,
                                  getattr(config, "moe", None) is not None)
        kernels = self.compiled_kernels()
        if route.linears.packed:
            pack_linears(model, kernels, route.linears)
        if route.linears.tiles:
            tile_linears(model)
        packer = self._decided.packer or QuantLinearPacker(kernels, route.quant, route.dtype)
        if prepare_quant_linears(model, packer):
            logger.info("quantized linears (%s): %s", describe_quantized(model),
                        route.quant.describe())
        if route.fused_elementwise:
            fused = {Rotary: lambda _: FusedRotary(kernels),
                     SiluAndMul: lambda _: FusedSiluAndMul(kernels),
                     RMSNorm: lambda norm: FusedRMSNorm(norm, kernels)}
            for module in list(model.modules()):
                for name, child in module.named_children():
                    if type(child) in fused:
                        setattr(module, name, fused[type(child)](child))
        if route.moe is not None and route.moe.fused:
            fuse_experts(model, kernels, route.quant)
        if route.layer_stack and hasattr(model, "layer_stack"):
            model.layer_stack = KernelLayerStack.of(model, kernels, route)
            if model.layer_stack is None:
                logger.info("C++ layer stack off for this model: tensor parallel, a linear "
                            "its small GEMM does not take, norms of differing eps, or a "
                            "mixture of experts")
        release_free_heap()  # what loading and packing freed (converted copies) goes back

    def quant_linear_packer(self, dtype: torch.dtype) -> QuantLinearPacker | None:
        """Packs each quantized linear as the loader reads it (the route is decided by then:
        the runner asks for its attention backend first); None before a route."""
        route = self.route
        if route is None or route.dtype != dtype:
            return None
        if self._decided.packer is None:
            self._decided.packer = QuantLinearPacker(self.compiled_kernels(), route.quant,
                                                     route.dtype)
        return self._decided.packer

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
        route = "" if self.route is None else f"; route: {self.route.describe()}"
        return (f"cpu (oneDNN-packed linears {state(self.packed_linears)}, malloc tuning "
                f"{state(self.malloc_tuning)}, KV cache huge pages {state(self.kv_huge_pages)}, "
                f"C++ kernels {state(kernels)}, batch-invariant "
                f"{state(self.batch_invariant)}{route})")


def model_dtype(model: nn.Module) -> torch.dtype:
    """The activations' dtype: its norms' (a quantized model's matrices are integers)."""
    return model.model.norm.weight.dtype if hasattr(model, "model") else next(
        model.parameters()).dtype


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
