"""A mixture-of-experts layer's experts through the fused kernel (`csrc/moe/moe_experts.cpp`).

`FusedExperts` replaces a `models.moe.Experts` where the route says so (`CpuRoute.moe`):
the experts' weights are packed once here (`pack_moe_experts`; the stacked parameters are
dropped with the module they belonged to), and each call is one `moe_experts`: the step's
(row, expert) pairs sorted by expert, one grouped GEMM over the gate/up with SiLU x up in its
tiles, one over the downs, each row's weighted sum in ascending expert order. The model's
loop over the experts (`Experts.forward`) is its reference; each row's result is independent
of the others, so the batch-invariant mode keeps it. `KernelRouter` replaces the block's
`route` (a float32 softmax, the top k, renormalised: five ATen calls) by one `moe_route`.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from carpool.models.moe import Experts, SparseMoeBlock


class FusedExperts(nn.Module):
    def __init__(self, experts: Experts, kernels: ModuleType) -> None:
        super().__init__()
        self.kernels = kernels
        self.gate_up, self.down = kernels.pack_moe_experts(experts.gate_up_proj.detach(),
                                                           experts.down_proj.detach())

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.kernels.moe_experts(x, self.gate_up, self.down, ids, weights)


class KernelRouter:
    """`models.moe.route` in one kernel call (`moe_route`), the weights then cast as it casts
    them."""

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    def __call__(self, logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
                 dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = self.kernels.moe_route(logits, top_k, norm_topk_prob)
        return (weights if dtype is None else weights.to(dtype)), ids


def fuse_experts(model: nn.Module, kernels: ModuleType) -> int:
    """Swap every `Experts` inside `model` for a `FusedExperts`, and every sparse block's
    router for a `KernelRouter`; returns how many blocks."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, Experts)]
    for parent, name, child in targets:
        setattr(parent, name, FusedExperts(child, kernels))
        if isinstance(parent, SparseMoeBlock):
            parent.router = KernelRouter(kernels)
    return len(targets)
