"""How many KV blocks to allocate, and the cache tensors themselves.

First rule that applies wins: an explicit block count; a byte budget; on CUDA,
`gpu_memory_utilization` of the card minus what a profiling forward pass
peaked at; on CPU, a modest share of available RAM (the platform's numbers, see
`carpool.platform`). One extra *scratch* block
is allocated past the pool the scheduler sees: padding tokens of the static
baseline write there, so they never touch a real request's keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from carpool.attention import AttentionBackend
from carpool.models.config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one token's keys and values across all layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def from_model(cls, config: ModelConfig, block_size: int, dtype: torch.dtype,
                   num_kv_heads: int | None = None) -> KVCacheSpec:
        """`num_kv_heads`: the heads this rank holds under tensor parallelism (default all)."""
        return cls(config.num_layers, num_kv_heads or config.num_kv_heads, config.head_dim,
                   block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        # 2: keys and values
        return (2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
                * element_size)


def num_blocks_for_bytes(spec: KVCacheSpec, num_bytes: int, field: str) -> int:
    """Whole blocks fitting in `num_bytes`; ValueError naming `field` if not even one fits."""
    num_blocks = int(num_bytes) // spec.bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"{field} ({num_bytes} bytes) is too small for one KV block "
                         f"({spec.bytes_per_block} bytes)")
    return num_blocks


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device,
                       backend: AttentionBackend, zeros=torch.zeros) -> list[torch.Tensor]:
    """One zeroed tensor per layer in the backend's layout, with num_blocks + 1 (scratch) blocks.

    Zeroed so that masked-out slots never hold NaN (0 * NaN would leak into SDPA).
    `zeros(shape, dtype=, device=)` makes each (the platform's `kv_cache_zeros`).
    """
    shape = backend.kv_cache_shape(num_blocks + 1, spec.block_size)
    return [zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]


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
