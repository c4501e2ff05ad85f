"""A mixture of experts' experts kept quantized: one `QuantLinear` per expert for its stacked
gate/up and one for its down, so each goes through the platform's quantized kernels as any
quantized linear does (`PrepareLinear`), and no float copy of an expert is ever made.

`forward` is the model's loop over the experts hit (`moe.experts_loop`), each expert's
multiplies over its own rows. With the CPU kernels the platform runs the same loop in one call
on the same packed parts (`platform/cpu_moe.KernelQuantExperts`, `quant_moe_experts`), which
the C++ layer stack makes itself; this loop is its reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from carpool.models.moe import experts_loop
from carpool.models.quant.linear import QuantLinear


class QuantExperts(nn.Module):
    """Every expert's gate/up (`gate_up[e]`, [2I, H]) and down (`down[e]`, [H, I])."""

    def __init__(self, gate_up: list[QuantLinear], down: list[QuantLinear]) -> None:
        super().__init__()
        if len(gate_up) != len(down):
            raise ValueError(f"{len(gate_up)} gate/up linears for {len(down)} downs")
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return self._one_row(x, ids, weights)
        return experts_loop(x, ids, weights, lambda e, rows: self.gate_up[e](rows),
                            lambda e, rows: self.down[e](rows))

    def _one_row(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`experts_loop` for one row (a single stream's decode) without its grouping ops:
        the same experts in the same ascending order, each added to the sum as it adds them
        (0 + y is y), so the same values."""
        out = None
        for slot, expert in sorted(enumerate(ids[0].tolist()), key=lambda pair: pair[1]):
            gate, up = self.gate_up[expert](x).chunk(2, dim=-1)
            y = (self.down[expert](F.silu(gate) * up) * weights[:, slot, None]).to(x.dtype)
            out = y if out is None else out + y
        return out

    def kinds(self) -> list[str]:
        """The experts' source types, e.g. ["Q8_0"]."""
        return sorted({k for linear in (*self.gate_up, *self.down) for k in linear.kinds()})
