"""RoPE through the compiled `rotary_` kernel: one pass over q and k, in place.

A drop-in for `models.rope.Rotary` that `CpuPlatform.prepare_model` swaps in when the
C++ kernels are built. It gives `apply_rope`'s results to the bit (float32 and reduced
precision; see `csrc/fused_ops.cpp`) in one pass, where the eager path's slices, cat
and products are mostly per-op overhead at decode sizes.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn


class FusedRotary(nn.Module):
    def __init__(self, kernels: ModuleType) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.kernels.rotary_(q, k, cos.contiguous(), sin.contiguous())
        return q, k
