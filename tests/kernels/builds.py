"""Which builds of the C++ kernels the kernel tests run on (tests/platform imports it too)."""

from __future__ import annotations

import torch

from carpool import kernels as cpu_kernels


def kernel_builds() -> list[str | None]:
    """This CPU's build (None), and on an AVX512 CPU also the AVX2 build, whose loops
    (decode_one_pass_avx2.h, the AVX2 small GEMMs, the AVX2 elementwise and argmax loops
    among them) laptops and older servers run and CI would otherwise never execute."""
    builds: list[str | None] = [None]
    if (torch.backends.cpu.get_cpu_capability() == "AVX512"
            and "avx2" in cpu_kernels.cpu_flags()):
        builds.append("AVX2")
    return builds


def build_id(build: str | None) -> str:
    return (build or "native").lower()
