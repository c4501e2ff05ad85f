"""A decoder layer's elementwise passes through the compiled kernels, one pass each.

Drop-ins for the model's `Rotary`, `RMSNorm` and `SiluAndMul` modules that
`CpuPlatform.prepare_model` swaps in where the route says so (`CpuRoute.fused_elementwise`:
the C++ kernels are built; `csrc/elementwise/fused_ops.cpp`). At decode sizes the eager
versions are mostly per-op overhead (a bfloat16 `F.rms_norm` alone is six ATen ops; 61 norms
a step on the 135M model), and at prefill sizes each extra op is another pass over the rows.

- `FusedRotary`: `apply_rope`'s results to the bit, in every dtype.
- `FusedSiluAndMul`: the eager `F.silu(gate) * up` to the bit, in every dtype.
- `FusedRMSNorm`: in reduced precision the residual add and the norm in one pass
  (`F.rms_norm`'s results up to the last bit of some rows, as its sum of squares runs in
  another order; the add is eager's to the bit except for which NaN a NaN sum carries); in
  float32 Hugging Face's eager ops to the bit (again except for which NaN a NaN sum
  carries), in one call (the row sums by the `sum` that eager's `mean` runs, the add,
  squares and products in two passes around it).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from carpool.models.llama import RMSNorm, SiluAndMul


class FusedRotary(nn.Module):
    def __init__(self, kernels: ModuleType) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.kernels.rotary_(q, k, cos.contiguous(), sin.contiguous())
        return q, k


class FusedSiluAndMul(SiluAndMul):
    def __init__(self, kernels: ModuleType) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.stride(-1) != 1:
            return super().forward(x)
        return self.kernels.silu_and_mul(x)


class FusedRMSNorm(RMSNorm):
    """An `RMSNorm` (same weight, same eps) whose calls take the kernel: rows [T, dim] with or
    without a residual, and heads [T, H, dim] (the per-head q and k norms) without."""

    def __init__(self, norm: RMSNorm, kernels: ModuleType) -> None:
        nn.Module.__init__(self)
        self.weight, self.eps = norm.weight, norm.eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not self.kernel_takes(x, residual):
            return super().forward(x, residual)
        out, summed = self.kernels.rms_norm(x, residual, self.weight, self.eps)
        return out if residual is None else (out, summed)

    @staticmethod
    def kernel_takes(x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Rows [T, dim] with or without a residual, heads [T, H, dim] without; each with its
        last dim contiguous."""
        if x.stride(-1) != 1:
            return False
        if residual is None:
            return x.dim() in (2, 3)
        return x.dim() == 2 and residual.stride(-1) == 1
