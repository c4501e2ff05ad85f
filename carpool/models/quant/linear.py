"""The modules that multiply by quantized weights: `QuantLinear` (a linear layer whose weight
is one or more quantized parts stacked by output rows, as the decoder stacks q/k/v and
gate/up) and `QuantEmbedding` (token rows dequantized on lookup).

Each part keeps its own type: a Q4_K_M file stores v_proj in Q6_K beside q_proj and k_proj in
Q4_K, so a stacked layer cannot be one matrix. How a part multiplies is a callable per part,
`part_matmuls`: the PyTorch reference here (dequantize, then `F.linear`, in slices of rows so
no whole float copy is ever held), which a platform replaces with its kernels
(`carpool.platform.cpu_quant`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from carpool.models.quant.weight import QuantizedWeight, stack_rows, w8a8_product

Part = QuantizedWeight | torch.Tensor  # a float part is a plain [N, K] tensor
PartMatmul = Callable[[torch.Tensor], torch.Tensor]  # x [M, K] -> [M, N] in x's dtype

# Output rows dequantized at once by the reference path: bounds its float copy.
REFERENCE_ROWS = 1024


def reference_matmul(part: Part) -> PartMatmul:
    """x @ part.T computed from the dequantized part, REFERENCE_ROWS output rows at a time
    (x first as the part takes it: `QuantizedWeight.prepare_input`); W8A8 with per-column
    scales as integer products (`w8a8_product`)."""
    if isinstance(part, torch.Tensor):
        return lambda x: F.linear(x, part.to(x.dtype))

    def matmul(x: torch.Tensor) -> torch.Tensor:
        n = part.shape[0]
        if part.int8_product:
            return torch.cat([w8a8_product(x, part.qweight[start:start + REFERENCE_ROWS],
                                           part.scales[start:start + REFERENCE_ROWS])
                              for start in range(0, n, REFERENCE_ROWS)], dim=-1)
        x = part.prepare_input(x)
        pieces = [F.linear(x, part.rows(slice(start, start + REFERENCE_ROWS)).dequantize(x.dtype))
                  for start in range(0, n, REFERENCE_ROWS)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
    return matmul


def part_shape(part: Part) -> tuple[int, int]:
    return tuple(part.shape)


def part_kind(part: Part) -> str:
    return part.kind if isinstance(part, QuantizedWeight) else str(part.dtype).removeprefix(
        "torch.")


def merge_like_parts(parts: list[Part]) -> list[Part]:
    """Neighbouring parts that multiply alike stacked into one (`weight.stack_rows`; float
    parts of one dtype by `torch.cat`): fewer, larger calls, and no concatenation after."""
    merged: list[Part] = [parts[0]]
    for part in parts[1:]:
        last = merged[-1]
        if isinstance(part, QuantizedWeight) and isinstance(last, QuantizedWeight):
            stacked = stack_rows([last, part])
            if stacked is not None:
                merged[-1] = stacked
                continue
        elif isinstance(part, torch.Tensor) and isinstance(last, torch.Tensor) and \
                part.dtype == last.dtype:
            merged[-1] = torch.cat([last, part])
            continue
        merged.append(part)
    return merged


class QuantLinear(nn.Module):
    """y = x @ [part_0; part_1; ...].T + bias, each part multiplied by its own `part_matmuls`
    entry. Holds no parameters: the parts are loaded, never trained."""

    def __init__(self, parts: list[Part], bias: torch.Tensor | None) -> None:
        super().__init__()
        shapes = [part_shape(p) for p in parts]
        if len({k for _, k in shapes}) != 1:
            raise ValueError(f"stacked parts differ in in_features: {shapes}")
        self.in_features = shapes[0][1]
        self.out_features = sum(n for n, _ in shapes)
        self.part_kinds = [part_kind(p) for p in parts]  # as loaded, before merging
        self.parts = merge_like_parts(list(parts))
        self.bias = bias
        self.part_matmuls: list[PartMatmul] = [reference_matmul(p) for p in self.parts]
        self.stack_parts = None  # the packed parts a platform's layer stack multiplies by

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        outs = [matmul(flat) for matmul in self.part_matmuls]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def release_parts(self) -> None:
        """Drop the canonical parts once a platform gave every part a multiply of its own
        copy (a packed weight): two copies of every weight would double the model's memory.
        The layer keeps its shape and kinds; its multiplies can no longer be rebuilt."""
        self.parts = []

    def kinds(self) -> list[str]:
        """The source type of each stacked projection, e.g. ["Q4_K", "Q4_K", "Q6_K"]."""
        return list(self.part_kinds)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"parts={self.kinds()}, bias={self.bias is not None}")


# What a platform does to each quantized linear as the loader reads it (pack it, free the
# canonical parts): `Platform.quant_linear_packer`.
PrepareLinear = Callable[[QuantLinear], None]


class QuantEmbedding(nn.Module):
    """Token ids -> rows of a quantized embedding matrix, dequantized per lookup in `dtype`."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_q = weight
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weight_q.rows(input_ids).dequantize(self.dtype)

    def extra_repr(self) -> str:
        n, k = self.weight_q.shape
        return f"{n}, {k}, kind={self.weight_q.kind}"
