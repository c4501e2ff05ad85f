"""What every attention backend implements, and the step layout they all start from.

A step's packed batch is described once, backend-neutrally, by a `StepLayout`
(numpy; built by the runner from the scheduler's output). A backend turns it
into its own metadata once per step (`build_metadata`): tensors on the device,
frozen, read by every layer and never changed by one. Each layer then calls
`forward`, which writes the step's new keys and values into the paged cache
and attends.

The KV cache of one layer is `[2, num_kv_heads, num_blocks, block_size, head_dim]`
(keys, values; head-major). A token at position p of a request lives in slot
`block_ids[p // block_size] * block_size + p % block_size` of every head.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

import numpy as np
import torch


@dataclass(frozen=True)
class StepLayout:
    """Where each scheduled request's new tokens sit in the packed batch, and its KV in the cache.

        packed tokens:  | req 0: query_lens[0] tokens | req 1 | ... | padding rows |
        req i's queries: rows [query_starts[i], query_starts[i] + query_lens[i]),
                         at positions num_computed[i] .. num_computed[i] + query_lens[i] - 1

    The static baseline's padding tokens appear as one-token requests at position 0
    whose block table is the scratch block.
    """

    query_starts: np.ndarray  # [S] int64
    query_lens: np.ndarray  # [S] int64, >= 1
    num_computed: np.ndarray  # [S] int64: tokens of the request already in the cache
    # [S, max blocks] int32: row i's blocks covering positions 0..end, then block 0 (padding)
    block_table: np.ndarray
    slot_mapping: np.ndarray  # [T] int64: cache slot of each packed token's new K/V
    num_cache_blocks: int  # blocks in each layer's cache tensor (pool + scratch)
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.slot_mapping)

    def num_blocks(self, rows: np.ndarray) -> np.ndarray:
        """Blocks of the table each of the requests `rows` reaches this step."""
        return -(-(self.num_computed[rows] + self.query_lens[rows]) // self.block_size)


@dataclass(frozen=True)
class AttentionShape:
    """The per-layer attention sizes a backend is built for."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None  # keys older than this many positions are not attended
    dtype: torch.dtype | None = None  # of q, k, v and the cache (None: not known up front)

    @property
    def group_size(self) -> int:
        """Query heads sharing one kv head (1: MHA, num_heads: MQA)."""
        return self.num_heads // self.num_kv_heads


class AttentionBackend(ABC):
    """Writes new K/V into a layer's paged cache and attends; one instance per model.

    `kernels` is the compiled C++ kernels module (`carpool.kernels.load()`)
    when the platform provides one; a backend that has no use for it ignores it.
    """

    name: ClassVar[str]

    def __init__(self, shape: AttentionShape, device: torch.device,
                 kernels: ModuleType | None = None) -> None:
        self.shape = shape
        self.device = device
        self.kernels = kernels

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The cache tensor one layer needs (both built-in backends share the head-major one)."""
        return (2, self.shape.num_kv_heads, num_blocks, block_size, self.shape.head_dim)

    @abstractmethod
    def build_metadata(self, layout: StepLayout):
        """This step's frozen, device-side metadata; called once per step, before any layer."""

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               meta, scale: float) -> torch.Tensor:
        """q [T, H, D] -> out [T, H, D]; the cache already holds this step's k, v [T, Hkv, D]."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta, scale: float) -> torch.Tensor:
        """Store this step's k, v in the cache, then attend every query."""
        write_kv(kv_cache, meta.slot_mapping, k, v, self.kernels)
        return self.attend(q, k, v, kv_cache, meta, scale)


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, kernels: ModuleType | None = None) -> None:
    """Store new k, v [T, num_kv_heads, head_dim] at their slots of `kv_cache` (in place);
    in one pass of the compiled `write_kv_` when `kernels` has it and the cache is on CPU."""
    if kernels is not None and kv_cache.device.type == "cpu":
        kernels.write_kv_(kv_cache, slot_mapping, k, v)
        return
    slots = kv_cache.view(2, kv_cache.shape[1], -1, kv_cache.shape[-1])  # (2, Hkv, slots, D)
    slots[0].index_copy_(1, slot_mapping, k.transpose(0, 1))
    slots[1].index_copy_(1, slot_mapping, v.transpose(0, 1))
