"""A mixture-of-experts layer's experts through the fused kernel (`csrc/moe/moe_experts.cpp`).

`FusedExperts` replaces a `models.moe.Experts` where the route says so (`CpuRoute.moe`):
the experts' weights are packed once here (`pack_moe_experts`; the stacked parameters are
dropped with the module they belonged to), and each call is one `moe_experts`: the step's
(row, expert) pairs sorted by expert, one grouped GEMM over the gate/up with SiLU x up in its
tiles, one over the downs, each row's weighted sum in ascending expert order. The model's
loop over the experts (`Experts.forward`) is its reference; each row's result is independent
of the others, so the batch-invariant mode keeps it. `KernelRouter` replaces the block's
`route` (a float32 softmax, the top k, renormalised: five ATen calls) by one `moe_route`.

`KernelQuantExperts` does the same for experts kept quantized (`models.quant.experts`): one
`quant_moe_experts` call (`csrc/moe/quant_experts.cpp`) runs the loop its `QuantExperts`
runs over its quantized linears, on the same packed parts, to the bit; the `QuantExperts` stays
inside it, its reference (and what names the experts' types).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from carpool.models.moe import Experts, SparseMoeBlock
from carpool.models.quant.experts import QuantExperts
from carpool.platform.cpu_route import QuantRoute


class FusedExperts(nn.Module):
    def __init__(self, experts: Experts, kernels: ModuleType) -> None:
        super().__init__()
        self.kernels = kernels
        self.gate_up, self.down = kernels.pack_moe_experts(experts.gate_up_proj.detach(),
                                                           experts.down_proj.detach())

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.kernels.moe_experts(x, self.gate_up, self.down, ids, weights)


class KernelQuantExperts(nn.Module):
    """A `QuantExperts` run by one kernel call: its linears' packed parts (`stack_parts`, the
    copies their own multiplies read) gathered once into the kernels' `QuantExperts`."""

    def __init__(self, experts: QuantExperts, packed, kernels: ModuleType) -> None:
        super().__init__()
        self.reference = experts
        self.packed = packed
        self.kernels = kernels

    @classmethod
    def of(cls, experts: QuantExperts, kernels: ModuleType,
           route: QuantRoute) -> KernelQuantExperts | None:
        """None where some linear's parts are not all packed with a plain input and no bias
        (no packed parts, a W8A8 or permuted input): those keep the module's loop."""
        linears = [*experts.gate_up, *experts.down]
        if any(lin.stack_parts is None or lin.stack_parts.int8_input or lin.bias is not None
               or any(part.w8a8 for part in lin.stack_parts.packed) for lin in linears):
            return None
        def parts(group):
            return [lin.stack_parts.packed for lin in group]

        def cuts(group):  # each part's, as its own multiply takes it (`part_matmul`)
            return [[route.max_rows(p.bits) for p in lin.stack_parts.packed] for lin in group]

        packed = kernels.QuantExperts(parts(experts.gate_up), parts(experts.down),
                                      cuts(experts.gate_up), cuts(experts.down),
                                      route.rounded_from)
        return cls(experts, packed, kernels)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.kernels.quant_moe_experts(x, self.packed, ids, weights)

    def kinds(self) -> list[str]:
        return self.reference.kinds()


class KernelRouter:
    """`models.moe.route` in one kernel call (`moe_route`), the weights then cast as it casts
    them."""

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    def __call__(self, logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
                 dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = self.kernels.moe_route(logits, top_k, norm_topk_prob)
        return (weights if dtype is None else weights.to(dtype)), ids


def fuse_experts(model: nn.Module, kernels: ModuleType, quant: QuantRoute) -> int:
    """Swap every `Experts` inside `model` for a `FusedExperts`, every `QuantExperts` the
    kernel takes for a `KernelQuantExperts`, and those blocks' routers for a `KernelRouter`;
    returns how many blocks."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if isinstance(child, (Experts, QuantExperts))]
    fused = 0
    for parent, name, child in targets:
        experts = FusedExperts(child, kernels) if isinstance(child, Experts) else \
            KernelQuantExperts.of(child, kernels, quant)
        if experts is None:
            continue
        setattr(parent, name, experts)
        if isinstance(parent, SparseMoeBlock):
            parent.router = KernelRouter(kernels)
        fused += 1
    return fused
