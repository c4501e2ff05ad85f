"""What the route is decided from: this CPU's class (`CpuFacts`) and what the loaded kernels
build runs here (`KernelFacts`). Facts only; `cpu_route` turns them into decisions.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from types import ModuleType

import torch

from carpool.kernels.cpu_info import cpu_flags, is_zen4


class CpuClass(enum.Enum):
    """What moves a cut: the vector ISA torch and the kernels dispatch to, AMX tiles, and Zen 4's
    half-width AVX-512 units."""

    AMX = "AMX"
    AVX512_BF16 = "AVX512-BF16"
    ZEN4 = "Zen 4"
    AVX512 = "AVX512"
    AVX2 = "AVX2"
    OTHER = "no AVX2"


@dataclass(frozen=True)
class CpuFacts:
    """This CPU as the route sees it (`probe()`; tests build their own)."""

    capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX512", "AVX2", "DEFAULT"
    amx: bool  # oneDNN runs AMX tiles (torch.cpu._is_amx_tile_supported)
    zen4: bool  # an AMD Zen 4 core (carpool.kernels.is_zen4)
    avx512_bf16: bool  # the avx512_bf16 flag
    onednn: bool = True  # torch.backends.mkldnn.is_available()
    onednn_bf16: bool = True  # oneDNN's matmul has a bfloat16 kernel (AVX512BW/VL/DQ or newer)

    @property
    def cpu_class(self) -> CpuClass:
        """AVX2 first (its builds run 256-bit code whatever the flags), then AMX, Zen 4."""
        if self.capability == "AVX2":
            return CpuClass.AVX2
        if self.amx:
            return CpuClass.AMX
        if self.zen4:
            return CpuClass.ZEN4
        if self.capability != "AVX512":
            return CpuClass.OTHER
        return CpuClass.AVX512_BF16 if self.avx512_bf16 else CpuClass.AVX512

    @staticmethod
    @functools.cache
    def probe() -> CpuFacts:
        """This machine's facts, read once per process."""
        return CpuFacts(capability=torch.backends.cpu.get_cpu_capability(),
                        amx=torch.cpu._is_amx_tile_supported(), zen4=is_zen4(),
                        avx512_bf16="avx512_bf16" in cpu_flags(),
                        onednn=torch.backends.mkldnn.is_available(),
                        onednn_bf16=torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(frozen=True)
class KernelFacts:
    """What the loaded kernels build runs here (`of(module, head_dim)`; tests build their own)."""

    max_head_dim: int  # paged_attention keeps a query row in registers up to this
    small_gemm_bf16: bool  # has_small_gemm_bf16: AVX512-BF16, or AVX2 builds in float32 FMAs
    small_gemm_f32: bool  # has_f32_gemm: AVX-512 or AVX2 builds
    bf16_gemm: bool  # has_bf16_gemm: AVX512-BF16 (prefill_attention_bf16 runs)
    amx: bool  # has_amx: the build and CPU run AMX tiles
    prefill_head_dim_ok: bool  # prefill_attention_bf16 takes the model's head_dim
    quant_gemm: bool = False  # quant_linear: int8 / int4 weights multiplied in registers
    moe_experts: bool = False  # moe_experts: a mixture of experts' experts in one call

    @staticmethod
    def of(kernels: ModuleType, head_dim: int) -> KernelFacts:
        return KernelFacts(max_head_dim=kernels.max_head_dim(),
                           small_gemm_bf16=kernels.has_small_gemm_bf16(),
                           small_gemm_f32=kernels.has_f32_gemm(),
                           bf16_gemm=kernels.has_bf16_gemm(), amx=kernels.has_amx(),
                           prefill_head_dim_ok=kernels.prefill_head_dim_ok(head_dim),
                           quant_gemm=hasattr(kernels, "quant_linear"),
                           moe_experts=hasattr(kernels, "moe_experts"))
