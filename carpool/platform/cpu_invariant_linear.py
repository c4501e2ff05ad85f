"""Batch-invariant linears: a row's result never depends on how many rows its step has.

A GEMM library picks its kernel, and with it the order in which a row's products are
summed, from the call's shape: on this project's machine oneDNN's 1-row path (K = 1536,
the 135M model's down_proj) differs in the last bits from its many-row kernel, and MKL's
float32 sgemm differs at every row count. So in batch-invariant mode every call has one of
a few fixed row counts: the step's rows are cut into tiles of `LARGER_TILES` rows while
they last, then of `BASE_ROWS`, the last one zero-padded (`in_row_tiles`). A row's place
within a call does not change its sums (measured; the invariance tests hold it).

A larger tile is used only where it was shown to agree: at load, each layer shape's
larger tile multiplies a random input, and it is kept only if every row equals bitwise
what `BASE_ROWS`-row calls give (`agreeing_tiles`). A kernel's summation order depends on
the shape, never on the values, and two orders differ on random data at some of the
tile's thousands of outputs, so one check per shape settles it; a shape whose larger tiles
disagree keeps `BASE_ROWS`-row calls only. `BASE_ROWS` = 16 is where oneDNN's cost per row
stops falling on the 135M shapes (31 us per row at 16, 23 at 512 in bfloat16; flat in
float32); the larger tiles win back most of the rest on prefills (BENCHMARKS.md §15).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from carpool.platform.cpu_linear import PackedLinear

BASE_ROWS = 16  # every step's last, padded call; and every call of a shape nothing else matches
LARGER_TILES = (256, 64)  # largest first, each a multiple of BASE_ROWS

Matmul = Callable[[torch.Tensor], torch.Tensor]


def in_row_tiles(x: torch.Tensor, tiles: tuple[int, ...], matmul: Matmul) -> torch.Tensor:
    """matmul over x [n, in] in calls of exactly one of `tiles` rows (largest first while
    they fill; the last call, of tiles[-1] rows, zero-padded) -> [n, out]."""
    num_rows = x.shape[0]
    pieces, start = [], 0
    for rows in tiles:
        while num_rows - start >= rows:
            pieces.append(matmul(x[start:start + rows]))
            start += rows
    if start < num_rows:
        padding = tiles[-1] - (num_rows - start)
        pieces.append(matmul(F.pad(x[start:], (0, 0, 0, padding)))[:num_rows - start])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def agreeing_tiles(matmul: Matmul, in_features: int, dtype: torch.dtype) -> tuple[int, ...]:
    """LARGER_TILES whose calls give every row of a random input bitwise what BASE_ROWS-row
    calls give, then BASE_ROWS."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(max(LARGER_TILES), in_features, generator=gen).to(dtype)
    expected = in_row_tiles(x, (BASE_ROWS,), matmul)
    return tuple(rows for rows in LARGER_TILES
                 if torch.equal(in_row_tiles(x, (rows,), matmul), expected)) + (BASE_ROWS,)


class RowTiledLinear(nn.Module):
    """A linear layer computed by `matmul` in calls of exactly one of `tiles` rows."""

    def __init__(self, linear: nn.Module, matmul: Matmul, tiles: tuple[int, ...]) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # kept: tied embeddings, inspection
        self.matmul = matmul
        self.tiles = tiles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = in_row_tiles(x.reshape(-1, self.in_features), self.tiles, self.matmul)
        return out.view(*x.shape[:-1], self.out_features)


def tile_linears(model: nn.Module) -> int:
    """Replace every `PackedLinear` (oneDNN on exactly the rows given) and `nn.Linear`
    (`F.linear`) inside `model` with a `RowTiledLinear`, its tiles checked once per layer
    shape; returns how many."""
    tiles_of: dict[tuple, tuple[int, ...]] = {}
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if isinstance(child, (PackedLinear, nn.Linear))]
    with torch.inference_mode():
        for parent, name, child in targets:
            if isinstance(child, PackedLinear):
                matmul = child.packed_matmul
            else:
                def matmul(rows, linear=child):
                    return F.linear(rows, linear.weight, linear.bias)
            key = (type(child), child.in_features, child.out_features, child.weight.dtype,
                   child.bias is None)
            if key not in tiles_of:
                tiles_of[key] = agreeing_tiles(matmul, child.in_features, child.weight.dtype)
            setattr(parent, name, RowTiledLinear(child, matmul, tiles_of[key]))
    return len(targets)
