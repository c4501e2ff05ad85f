"""Quantized linears on the CPU: each part of every `QuantLinear` gets the multiply the route
picks (`cpu_route.QuantRoute`).

W8A8 with per-channel weight scales takes the compiled int8 x int8 product (`w8a8_linear`)
at every row count. Otherwise few-row calls (decodes, short chunks, the sampled rows' LM
head) take the compiled `quant_linear`, which reads each weight byte once and dequantizes
in registers: decoding is bound by the bytes of weights read, and int8 / int4 weights are
a half / a quarter of bfloat16's. Larger calls dequantize slices of the weight into the
activations' dtype and multiply with `F.linear` (the reference path of
`models.quant.linear`), where the arithmetic, not the weight's bytes, is the cost. Under
batch invariance the compiled kernel takes every call (a row's sums never depend on the
others), or without it the reference runs in the invariant tiles of `cpu_invariant_linear`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from carpool.kernels.quant_rows import quant_matmul
from carpool.models.quant.linear import PartMatmul, QuantLinear, reference_matmul
from carpool.models.quant.weight import QuantizedWeight
from carpool.platform.cpu_invariant_linear import agreeing_tiles, in_row_tiles
from carpool.platform.cpu_route import ALL_ROWS, QuantRoute


def quant_linears(model: nn.Module) -> list[QuantLinear]:
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


class QuantLinearPacker:
    """Gives a `QuantLinear` the route's multiply for each part and frees its canonical parts.
    The loaders call it on each linear as soon as it is read (`Platform.quant_linear_packer`),
    so one layer's canonical copy at a time exists beside the packed ones; `prepare_model`
    calls it on any linear left. A layer is prepared once however often it is passed."""

    def __init__(self, kernels: ModuleType | None, route: QuantRoute,
                 dtype: torch.dtype) -> None:
        self.kernels, self.route, self.dtype = kernels, route, dtype
        self._tiles_of: dict[tuple, tuple[int, ...]] = {}  # invariant tiles per part shape
        self._prepared: set[int] = set()  # ids of the linears done

    def __call__(self, linear: QuantLinear) -> None:
        if id(linear) in self._prepared:
            return
        route, matmuls, packed_parts = self.route, [], []
        for part in linear.parts:
            packed = pack_part(part, self.kernels, route)
            packed_parts.append(packed)
            matmul = part_matmul(part, packed, route)
            if route.tiles:
                key = (type(part), *part.shape, getattr(part, "kind", None))
                if key not in self._tiles_of:
                    with torch.inference_mode():
                        self._tiles_of[key] = agreeing_tiles(matmul, part.shape[1], self.dtype)

                def matmul(x, inner=matmul, tiles=self._tiles_of[key]):
                    return in_row_tiles(x, tiles, inner)
            matmuls.append(matmul)
        linear.part_matmuls = matmuls
        linear.stack_parts = stack_parts(packed_parts, route)
        if all(packed is not None or not isinstance(part, QuantizedWeight)
               for part, packed in zip(linear.parts, packed_parts)):
            # every part is packed: the packed copy is the only one its multiply reads
            linear.release_parts()
        self._prepared.add(id(linear))


def prepare_quant_linears(model: nn.Module, packer: QuantLinearPacker) -> int:
    """Give every `QuantLinear` in `model` the route's multiplies (those the loader did not
    already pass to `packer`); returns how many layers the model has."""
    linears = quant_linears(model)
    for linear in linears:
        packer(linear)
    return len(linears)


@dataclass(frozen=True)
class PackedPart:
    """One part packed for `quant_linear`: its rows cut, and how its input is prepared."""

    kernels: ModuleType
    packed: object  # the kernels' QuantWeight
    max_rows: int
    prepare: Callable[[torch.Tensor], torch.Tensor]  # `QuantizedWeight.input_preparation`
    plain_input: bool  # prepare is the identity (no permutation, no int8 rounding)
    int8_input: bool  # prepare is int8_per_token alone (W8A8), which the layer stack runs


@dataclass(frozen=True)
class StackParts:
    """A quantized linear as the C++ layer stack runs it (`StackLinear.quantized`): every
    part packed with a plain input, or every one with W8A8's int8-rounded input, up to the
    smallest of their cuts."""

    packed: list
    max_rows: int
    rounded_from: int
    int8_input: bool = False


def pack_part(part, kernels: ModuleType | None, route: QuantRoute) -> PackedPart | None:
    """The part packed for the compiled kernel, or None where the reference multiplies it (a
    float part, no kernels, or a route without the kernel)."""
    if not isinstance(part, QuantizedWeight) or kernels is None or not route.max_rows(part.bits):
        return None
    if part.int8_product:
        # W8A8 per channel: int8 x int8 at every row count (the kernel rounds x per token
        # itself; exact sums, so no cut between a few-row and a many-row multiply)
        packed = kernels.pack_w8a8_weight(part.qweight, part.scales)
        return PackedPart(kernels, packed, ALL_ROWS, lambda x: x, True, False)
    bits = packed_bits(part)
    packed = kernels.pack_quant_weight(part.qweight, part.scales, part.mins, bits,
                                       part.group_size, f16_header(part))
    # W8A8's activation rounding by the kernel: one pass a row, the eager ops' bits
    return PackedPart(kernels, packed, route.max_rows(bits),
                      part.input_preparation(kernels.int8_per_token),
                      part.input_perm is None and not part.input_int8,
                      part.input_perm is None and part.input_int8)


def part_matmul(part, packed: PackedPart | None, route: QuantRoute) -> PartMatmul:
    """The multiply of one part: the compiled kernel up to its cut where it is packed, else
    the reference (float parts: always `F.linear`). The closure holds the packed copy only,
    so the canonical one can be freed."""
    if packed is None:
        return reference_matmul(part)
    kernels, weight, max_rows, prepare = packed.kernels, packed.packed, packed.max_rows, \
        packed.prepare

    def matmul(x: torch.Tensor) -> torch.Tensor:
        # the kernel takes x as the stored matrix does (a permuted or int8-rounded input)
        return quant_matmul(kernels, prepare(x).contiguous(), weight, None, max_rows,
                            route.rounded_from)
    return matmul


def stack_parts(parts: list[PackedPart | None], route: QuantRoute) -> StackParts | None:
    """The layer's parts for the C++ layer stack, where every one is packed and takes x as it
    is, or every one x rounded by int8_per_token (else the stack calls the module back); None
    under the invariant tiles."""
    if route.tiles or not parts or any(p is None for p in parts):
        return None
    kinds = {(p.plain_input, p.int8_input) for p in parts}
    if kinds == {(True, False)} or kinds == {(False, True)}:
        return StackParts([p.packed for p in parts], min(p.max_rows for p in parts),
                          route.rounded_from, int8_input=parts[0].int8_input)
    return None


def packed_bits(part: QuantizedWeight) -> int:
    """The bits a weight is packed in: an int8 weight whose values fit five bits (GGUF's Q5_0,
    the type llama.cpp's Q4_K_M files fall back to where a row is not a multiple of 256) in
    five, which the kernel reads as 5/8 of the bytes; one whose values fit six (GGUF's Q6_K)
    in bits 6, still a byte a weight but in pairs that one table lookup turns into bfloat16
    (the same sums as bits 8); else the canonical bits."""
    if part.bits == 8 and part.qweight.numel():
        q = part.qweight
        low, high = int(q.min()), int(q.max())
        if part.group_size % 32 == 0 and low >= -16 and high <= 15:
            return 5
        if part.group_size % 2 == 0 and low >= -32 and high <= 31:
            return 6
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
