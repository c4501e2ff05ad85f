"""How many KV blocks to allocate, and the cache tensors themselves.

First rule that applies wins: an explicit block count; a byte budget; on CUDA,
`gpu_memory_utilization` of the card minus what a profiling forward pass
peaked at; on CPU, a modest share of available RAM. One extra *scratch* block
is allocated past the pool the scheduler sees: padding tokens of the static
baseline write there, so they never touch a real request's keys and values.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from carpool.models.config import ModelConfig

logger = logging.getLogger(__name__)

CPU_DEFAULT_FRACTION = 0.10  # of available RAM
CPU_DEFAULT_MAX_BYTES = 4 * 1024**3


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one token's keys and values across all layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def from_model(cls, config: ModelConfig, block_size: int, dtype: torch.dtype) -> "KVCacheSpec":
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        # 2: keys and values
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size


def num_blocks_for_bytes(spec: KVCacheSpec, num_bytes: int, field: str) -> int:
    """Whole blocks fitting in `num_bytes`; ValueError naming `field` if not even one fits."""
    num_blocks = int(num_bytes) // spec.bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"{field} ({num_bytes} bytes) is too small for one KV block "
                         f"({spec.bytes_per_block} bytes)")
    return num_blocks


def cpu_default_bytes() -> int:
    """min(10% of available RAM, 4 GiB)."""
    return min(int(available_ram_bytes() * CPU_DEFAULT_FRACTION), CPU_DEFAULT_MAX_BYTES)


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


def cuda_free_bytes_after_profile(device: torch.device, utilization: float) -> int:
    """Bytes left for the KV cache: utilization * card memory minus the profiled peak.

    Call after a profiling forward at the largest batch (peak stats include it).
    """
    total = torch.cuda.get_device_properties(device).total_memory
    peak = torch.cuda.max_memory_allocated(device)
    # Memory outside PyTorch's allocator (other processes, CUDA context) also counts.
    free, _ = torch.cuda.mem_get_info(device)
    used_elsewhere = max(total - free - torch.cuda.memory_reserved(device), 0)
    budget = int(total * utilization) - peak - used_elsewhere
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization ({utilization}) leaves no room for the KV "
                         f"cache: weights and activations peak at {peak} bytes of {total}")
    return budget


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed tensor per layer: [2, kv_heads, num_blocks + 1 (scratch), block_size, head_dim].

    Head-major, so that gathering a request's blocks for one head yields its keys as one
    contiguous [context, head_dim] matrix (see `attention.py`). Zeroed so that
    masked-out slots never hold NaN (0 * NaN would leak into SDPA).
    """
    shape = (2, spec.num_kv_heads, num_blocks + 1, spec.block_size, spec.head_dim)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]


def kv_cache_info(spec: KVCacheSpec, num_blocks: int, max_model_len: int) -> dict:
    """What was allocated, in the units operators reason in."""
    blocks_per_seq = -(-max_model_len // spec.block_size)
    return {
        "num_blocks": num_blocks,
        "block_size": spec.block_size,
        "num_tokens": num_blocks * spec.block_size,
        "bytes": num_blocks * spec.bytes_per_block,
        "max_concurrency": num_blocks / blocks_per_seq,  # requests of max_model_len at once
    }
