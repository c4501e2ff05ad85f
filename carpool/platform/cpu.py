"""The CPU platform: malloc tuning for the process, oneDNN-packed linears for the model,
and a modest share of RAM for the KV cache. Both tunings are config switches
(`cpu_malloc_tuning`, `cpu_packed_linears`), on by default because they help here."""

from __future__ import annotations

import os
from dataclasses import dataclass

from torch import nn

from carpool.platform.base import Platform
from carpool.platform.cpu_linear import can_pack, pack_linears
from carpool.platform.cpu_memory import keep_freed_memory_in_heap

CPU_DEFAULT_FRACTION = 0.10  # of available RAM
CPU_DEFAULT_MAX_BYTES = 4 * 1024**3


@dataclass(frozen=True)
class CpuPlatform(Platform):
    packed_linears: bool = True
    malloc_tuning: bool = True

    def prepare_process(self) -> None:
        if self.malloc_tuning:
            keep_freed_memory_in_heap()

    def prepare_model(self, model: nn.Module) -> None:
        if self.packed_linears and can_pack(model):
            pack_linears(model)

    def default_kv_cache_bytes(self) -> int:
        """min(10% of available RAM, 4 GiB)."""
        return min(int(available_ram_bytes() * CPU_DEFAULT_FRACTION), CPU_DEFAULT_MAX_BYTES)

    def describe(self) -> str:
        return (f"cpu (oneDNN-packed linears {'on' if self.packed_linears else 'off'}, "
                f"malloc tuning {'on' if self.malloc_tuning else 'off'})")


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
