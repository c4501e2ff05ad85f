"""Quantized linears on the CPU: each part of every `QuantLinear` gets the multiply the route
picks (`cpu_route.QuantRoute`).

Few-row calls (decodes, short chunks, the sampled rows' LM head) take the compiled
`quant_linear`, which reads each weight byte once and dequantizes in registers: decoding is
bound by the bytes of weights read, and int8 / int4 weights are a half / a quarter of
bfloat16's. Larger calls dequantize slices of the weight into the activations' dtype and
multiply with `F.linear` (the reference path of `models.quant.linear`), where the arithmetic,
not the weight's bytes, is the cost. Under batch invariance the compiled kernel takes every
call (a row's sums never depend on the others), or without it the reference runs in the
invariant tiles of `cpu_invariant_linear`.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from carpool.kernels.quant_rows import quant_matmul
from carpool.models.quant.linear import PartMatmul, QuantLinear, reference_matmul
from carpool.models.quant.weight import QuantizedWeight
from carpool.platform.cpu_invariant_linear import agreeing_tiles, in_row_tiles
from carpool.platform.cpu_route import QuantRoute


def quant_linears(model: nn.Module) -> list[QuantLinear]:
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


def prepare_quant_linears(model: nn.Module, kernels: ModuleType | None, route: QuantRoute,
                          dtype: torch.dtype) -> int:
    """Give every part of every `QuantLinear` in `model` the route's multiply; returns how
    many layers."""
    linears = quant_linears(model)
    tiles_of: dict[tuple, tuple[int, ...]] = {}
    for linear in linears:
        matmuls = []
        for part in linear.parts:
            matmul = part_matmul(part, kernels, route)
            if route.tiles:
                key = (type(part), *part.shape, getattr(part, "kind", None))
                if key not in tiles_of:
                    with torch.inference_mode():
                        tiles_of[key] = agreeing_tiles(matmul, part.shape[1], dtype)

                def matmul(x, inner=matmul, tiles=tiles_of[key]):
                    return in_row_tiles(x, tiles, inner)
            matmuls.append(matmul)
        linear.part_matmuls = matmuls
        if kernels is not None and all(not isinstance(part, QuantizedWeight)
                                       or route.max_rows(part.bits) for part in linear.parts):
            # every part is packed: the packed copy is the only one its multiply reads
            linear.release_parts()
    return len(linears)


def part_matmul(part, kernels: ModuleType | None, route: QuantRoute) -> PartMatmul:
    """The multiply of one part: the compiled kernel up to route.max_rows rows, else the
    reference (float parts: always `F.linear`)."""
    if not isinstance(part, QuantizedWeight) or kernels is None or not route.max_rows(part.bits):
        return reference_matmul(part)
    bits = packed_bits(part)
    packed = kernels.pack_quant_weight(part.qweight, part.scales, part.mins, bits,
                                       part.group_size, f16_header(part))
    max_rows = route.max_rows(bits)
    # the kernel takes x as the stored matrix does (a permuted or int8-rounded input); the
    # closure holds the packed copy only, so the canonical one can be freed
    prepare = part.input_preparation()

    def matmul(x: torch.Tensor) -> torch.Tensor:
        return quant_matmul(kernels, prepare(x).contiguous(), packed, None, max_rows,
                            route.rounded_from)
    return matmul


def packed_bits(part: QuantizedWeight) -> int:
    """The bits a weight is packed in: an int8 weight whose values fit five bits (GGUF's Q5_0,
    the type llama.cpp's Q4_K_M files fall back to where a row is not a multiple of 256) in
    five, which the kernel reads as 5/8 of the bytes; else the canonical bits."""
    if part.bits == 8 and part.group_size % 32 == 0 and part.qweight.numel():
        q = part.qweight
        if int(q.min()) >= -16 and int(q.max()) <= 15:
            return 5
    return part.bits


def f16_header(part: QuantizedWeight) -> bool:
    """Whether the packed weight keeps its scales and mins as float16: where every one is
    exact in float16 (GGUF's Q8_0, Q5_0 and Q4_0 store theirs so), which halves the bytes the
    kernel reads besides q, at no change to any result."""
    def exact(t: torch.Tensor | None) -> bool:
        return t is None or torch.equal(t.half().float(), t)
    return exact(part.scales) and exact(part.mins)


def describe_quantized(model: nn.Module) -> str | None:
    """The quantized layers' part types with their counts, e.g. "Q4_K x120, Q6_K x24"; None
    for a model without any."""
    counts: dict[str, int] = {}
    for linear in quant_linears(model):
        for kind in linear.kinds():
            counts[kind] = counts.get(kind, 0) + 1
    if not counts:
        return None
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
