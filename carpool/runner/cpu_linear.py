"""float32 linear layers through oneDNN with their weights packed once, on CPU.

PyTorch sends a float32 `F.linear` on CPU to MKL's sgemm, which on this
project's benchmark machine (AMD EPYC, AVX-512) ran 2.7x (4096 rows) to 4.6x
(200 rows) slower than oneDNN's matmul on a weight reordered once at load time
(`torch.ops.mkldnn._reorder_linear_weight` + `_linear_pointwise`, the pair
torch.compile's CPU weight freezing emits). bfloat16 linears already run on
oneDNN and are left alone. Results equal `F.linear`'s up to float32 rounding
(another summation order).
"""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Module):
    """An `nn.Linear` whose forward multiplies by a oneDNN-packed copy of its weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # kept: tied embeddings, inspection
        self.bias = linear.bias
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self._packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def can_pack(model: nn.Module) -> bool:
    """float32 weights on CPU with oneDNN available."""
    param = next(model.parameters(), None)
    return (param is not None and param.device.type == "cpu" and param.dtype == torch.float32
            and torch.backends.mkldnn.is_available())


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` inside `model` with a `PackedLinear`; returns how many."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
