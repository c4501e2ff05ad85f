"""float32 linear layers through oneDNN with their weights packed once, on CPU.

PyTorch sends a float32 `F.linear` on CPU to MKL's sgemm, which on this
project's benchmark machine (AMD EPYC, AVX-512) ran 2.7x (4096 rows) to 4.6x
(200 rows) slower than oneDNN's matmul on a weight reordered once at load time
(`torch.ops.mkldnn._reorder_linear_weight` + `_linear_pointwise`, the pair
torch.compile's CPU weight freezing emits). bfloat16 linears already run on
oneDNN and are left alone. Results equal `F.linear`'s up to float32 rounding
(another summation order).

Off by default (opt in with CARPOOL_ONEDNN_LINEAR=1): each new row count
(batch size) makes oneDNN build and cache another primitive, and resident
memory grows with the number of distinct step sizes seen. Measured: one
384x1024 layer fed row counts 1..1024 twice grew RSS 231 -> 2633 MiB, where
`F.linear` stayed at 222 -> 250 MiB; a 9-minute server soak levelled off at
+300 MiB. A server must not grow like that, so the MKL path stays the default
until the row counts are bucketed.
"""

from __future__ import annotations

import torch
from torch import nn

ONEDNN_LINEAR_ENV = "CARPOOL_ONEDNN_LINEAR"  # "1" turns packing on in ModelRunner


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
