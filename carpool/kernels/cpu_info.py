"""What this CPU is, read once from /proc/cpuinfo: the feature flags that pick the kernels'
build (AVX512-BF16, AMX) and the core family that moves the small GEMMs' row cuts."""

from __future__ import annotations

import functools
from pathlib import Path


def cpu_flags() -> set[str]:
    """This CPU's feature flags, from /proc/cpuinfo (empty where there is none)."""
    return set(cpuinfo().get("flags", "").split())


def is_zen4() -> bool:
    """Whether this CPU is an AMD Zen 4 core: family 25 (0x19) with AVX-512, which no other
    Zen generation of that family has. Its AVX-512 runs on 256-bit units, so which GEMM wins
    at a row count differs from Intel's cores and Zen 5's (`carpool.platform.cpu_route`)."""
    info = cpuinfo()
    return (info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family") == "25"
            and "avx512f" in info.get("flags", "").split())


@functools.cache
def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none); read once."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields
