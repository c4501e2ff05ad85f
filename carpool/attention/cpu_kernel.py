"""The CPU backend with the compiled kernels: one call of the C++ `attend` per layer for every
row of the step, reading keys and values in place through the block tables.

`attend` (csrc/attention/attend.h) is the one attention entry of a CPU step; the C++ layer
stack calls it too, so a row goes the same way whichever runs the layers. The route
(`carpool.attention.paths.decide_attention`) decides, once, which rows go where: bfloat16
prompt chunks (every request of 2+ tokens) to `prefill_attention_bf16` where the CPU has
AVX512-BF16, on AMX tiles where it has them; every other row to `paged_attention` (decodes,
and prompt chunks elsewhere: it beats PyTorch's query-block matmuls on fresh prompts too,
docs/lab/17-the-paged-attention-kernel-second-pass.md).

Batch-invariant mode: `paged_attention` is told to score every row the same way (no
transposed-key scoring for tiles of 4+ rows). A row then reduces its keys in 64-key chunks at
fixed positions, in position order, with its own online softmax, whatever its neighbours, its
tile or its prompt's chunking: its output depends on its query and its keys alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from carpool.attention import paged
from carpool.attention.base import AttentionBackend, AttentionShape, StepLayout
from carpool.attention.paths import AttentionRoute


@dataclass(frozen=True)
class KernelRows:
    """Requests a kernel attends, int32."""

    block_tables: torch.Tensor  # [S, max_blocks], padded with block 0 (never read)
    query_starts: torch.Tensor  # [S]
    query_lens: torch.Tensor  # [S]
    seq_lens: torch.Tensor  # [S]: tokens in the cache once this step's are written

    def as_list(self) -> list[torch.Tensor]:
        """The four tensors, in the order `attend` takes them."""
        return [self.block_tables, self.query_starts, self.query_lens, self.seq_lens]


@dataclass(frozen=True)
class KernelMetadata:
    """A step as `attend` takes it: every row in exactly one of the two lists."""

    slot_mapping: torch.Tensor  # [T] int64
    num_tokens: int
    paged_rows: KernelRows | None  # the requests paged_attention attends (None: no request)
    prefill_rows: KernelRows | None  # the requests prefill_attention_bf16 attends

    def attend_args(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(paged_rows, prefill_rows) as `attend` takes them (an empty list for none)."""
        return (_as_list(self.paged_rows), _as_list(self.prefill_rows))


class CpuKernelBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, shape: AttentionShape, device: torch.device, kernels: ModuleType,
                 route: AttentionRoute) -> None:
        super().__init__(shape, device, kernels)
        self.route = route
        self._sliding_window = shape.sliding_window or 0
        self._split_prompts = route.prefill_kernel

    def build_metadata(self, layout: StepLayout) -> KernelMetadata:
        slots = torch.as_tensor(layout.slot_mapping, device=self.device, dtype=torch.int64)
        if not self._split_prompts:  # paged_attention takes every row
            rows = np.arange(len(layout.query_lens))
            return KernelMetadata(slots, layout.num_tokens, _kernel_rows(layout, rows), None)
        is_chunk = layout.query_lens > 1
        decodes, chunks = np.flatnonzero(~is_chunk), np.flatnonzero(is_chunk)
        return KernelMetadata(slots, layout.num_tokens,
                              _kernel_rows(layout, decodes) if len(decodes) else None,
                              _kernel_rows(layout, chunks) if len(chunks) else None)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               meta: KernelMetadata, scale: float) -> torch.Tensor:
        paged_rows, prefill_rows = meta.attend_args()
        return self.kernels.attend(q, kv_cache, paged_rows, prefill_rows, scale,
                                   self._sliding_window, self.route.prefill_amx,
                                   self.route.batch_invariant)


def _as_list(rows: KernelRows | None) -> list[torch.Tensor]:
    return [] if rows is None else rows.as_list()


def _kernel_rows(layout: StepLayout, rows: np.ndarray) -> KernelRows:
    """The kernel's int32 view of the requests `rows` (the whole step without copies by index
    when they are all of it: the usual case)."""
    pick = slice(None) if len(rows) == len(layout.query_lens) else rows
    query_lens = layout.query_lens[pick]
    seq_lens = layout.num_computed[pick] + query_lens
    return KernelRows(
        block_tables=torch.from_numpy(paged.padded_block_tables(layout, rows, np.int32)),
        query_starts=torch.from_numpy(layout.query_starts[pick].astype(np.int32)),
        query_lens=torch.from_numpy(query_lens.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)))
