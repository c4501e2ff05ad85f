"""The portable backend: `scaled_dot_product_attention` over gathered blocks, on any device.

What CUDA runs (SDPA picks its fused kernels there), and runnable on CPU so that
CI checks the same lines. Fresh prompts take SDPA's causal path over this
step's k/v; decode groups and continuing chunks take SDPA with a boolean mask
over keys and values gathered from their block tables.

On CUDA every decode is in one group: each group is a handful of kernel launches per
layer, and a decode step there is bound by the host issuing launches, not by the
padding a group of mixed context lengths adds
(docs/lab/35-the-first-run-on-a-gpu-h200.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from carpool.attention import paged
from carpool.attention.base import AttentionBackend, AttentionShape, StepLayout


@dataclass(frozen=True)
class SdpaMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    groups: tuple[paged.PagedGroup, ...]  # decode groups, then the chunks' group
    fresh_spans: tuple[tuple[int, int], ...]  # (packed start, length) of each fresh prompt
    num_tokens: int


class SdpaBackend(AttentionBackend):
    name = "sdpa"

    def __init__(self, shape: AttentionShape, device: torch.device,
                 kernels: ModuleType | None = None) -> None:
        super().__init__(shape, device, kernels)
        self.max_decode_groups = 1 if device.type == "cuda" else paged.MAX_DECODE_GROUPS

    def build_metadata(self, layout: StepLayout) -> SdpaMetadata:
        split = paged.split_step(layout, fresh_fast_path=self.shape.sliding_window is None,
                                 max_decode_groups=self.max_decode_groups)
        groups = [paged.build_group(layout, rows, self.shape, self.device)
                  for rows in split.decode_groups + (split.chunks,) if len(rows)]
        slots = torch.as_tensor(layout.slot_mapping, device=self.device, dtype=torch.int64)
        return SdpaMetadata(slot_mapping=slots, groups=tuple(groups),
                            fresh_spans=paged.fresh_spans(layout, split.fresh),
                            num_tokens=layout.num_tokens)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               meta: SdpaMetadata, scale: float) -> torch.Tensor:
        out = torch.zeros_like(q)
        for group in meta.groups:
            out[group.valid_tokens] = paged.attend_group_sdpa(q, kv_cache, group, scale)
        for start, length in meta.fresh_spans:
            span = slice(start, start + length)
            out[span] = paged.attend_fresh_sdpa(q[span], k[span], v[span], scale)
        return out
