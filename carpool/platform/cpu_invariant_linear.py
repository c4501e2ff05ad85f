"""Batch-invariant linears: a row's result never depends on how many rows its step has.

A GEMM library picks its kernel, and with it the order in which a row's products are
summed, from the call's shape: oneDNN's 1-row path differs in the last bits from its
many-row kernel, and MKL's float32 sgemm differs at every row count. So in batch-invariant
mode every call has one of a few fixed row counts: the step's rows are cut into tiles of the
largest `TILES` while they fill, the rest in one call zero-padded to the smallest size that
holds it (`in_row_tiles`).
A row's place within a call does not change its sums (measured; the invariance tests hold
it).

Which tiles: at load, each layer shape multiplies a random input in calls of every size in
`TILES`, and keeps the sizes whose calls give every row bitwise what `REFERENCE_ROWS`-row
calls give (`agreeing_tiles`). A kernel's summation order depends on the shape, never on
the values, and two orders differ on random data at some of a call's thousands of outputs,
so one check per shape settles it. Here every size from 2 rows up agrees, so a lone decode
is padded to 2 rows, not 16, and prefills go in 256-row calls; a machine whose small calls
sum otherwise keeps the sizes from 16 up (about where oneDNN's cost per row stops falling:
docs/lab/16-batch-invariant-mode.md). Whether linears take tiles is the route's
(`cpu_route.LinearRoute.tiles`).

A layer the compiled vector small GEMM takes needs no tiles: its kernel sums a row's
products in one order whatever the call's rows, so under batch invariance the route gives it
every call (`cpu_route.ALL_ROWS`), and `tile_linears` leaves it be once `rows_independent`
has checked its shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from carpool.platform.cpu_linear import PackedLinear
from carpool.platform.cpu_route import ALL_ROWS

REFERENCE_ROWS = 16  # the call size every other one must agree with (always used)
TILES = (256, 64, 16, 8, 4, 2)  # the candidates, largest first
MIN_CHECKED_ROWS = 64  # rows of random input a small tile size is checked over

Matmul = Callable[[torch.Tensor], torch.Tensor]


def in_row_tiles(x: torch.Tensor, tiles: tuple[int, ...], matmul: Matmul) -> torch.Tensor:
    """matmul over x [n, in] -> [n, out] in calls of exactly one of `tiles` rows: calls of
    the sizes from REFERENCE_ROWS up while they fill (largest first), then one call for the
    rest, zero-padded to the smallest size that holds it (small calls cost more per row, so
    the rest is never cut further)."""
    num_rows = x.shape[0]
    pieces, start = [], 0
    for rows in tiles:
        while rows >= REFERENCE_ROWS and num_rows - start >= rows:
            pieces.append(matmul(x[start:start + rows]))
            start += rows
    if start < num_rows:
        rest = num_rows - start
        rows = min(size for size in tiles if size >= rest)
        pieces.append(matmul(F.pad(x[start:], (0, 0, 0, rows - rest)))[:rest])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _calls_of(x: torch.Tensor, rows: int, matmul: Matmul) -> torch.Tensor:
    """matmul over x in calls of exactly `rows` rows (x's rows a multiple of it)."""
    return torch.cat([matmul(x[start:start + rows]) for start in range(0, x.shape[0], rows)])


def agreeing_tiles(matmul: Matmul, in_features: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The sizes in TILES (largest first) whose calls give every row of a random input
    bitwise what REFERENCE_ROWS-row calls give; REFERENCE_ROWS among them."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(max(TILES), in_features, generator=gen).to(dtype)
    expected = _calls_of(x, REFERENCE_ROWS, matmul)
    agreeing = []
    for rows in TILES:
        checked = max(rows, MIN_CHECKED_ROWS)
        if rows == REFERENCE_ROWS or torch.equal(_calls_of(x[:checked], rows, matmul),
                                                 expected[:checked]):
            agreeing.append(rows)
    return tuple(agreeing)


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


def rows_independent(linear: PackedLinear) -> bool:
    """Whether `linear`'s small GEMM gives every row of a random input bitwise the same in one
    call of MIN_CHECKED_ROWS rows as in calls of 1 and of 13 (the kernel's tiles and their
    remainders): checked once per layer shape, as `agreeing_tiles` checks oneDNN's."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(MIN_CHECKED_ROWS, linear.in_features, generator=gen).to(
        linear.weight.dtype)
    whole = linear(x)
    return all(torch.equal(torch.cat([linear(x[start:start + rows])
                                      for start in range(0, x.shape[0], rows)]), whole)
               for rows in (1, 13))


def tile_linears(model: nn.Module) -> int:
    """Replace every `PackedLinear` (oneDNN on exactly the rows given) and `nn.Linear`
    (`F.linear`) inside `model` with a `RowTiledLinear`, its tiles checked once per layer
    shape; returns how many. A `PackedLinear` whose small GEMM takes every call
    (`cpu_route.ALL_ROWS`) and whose rows are independent stays as it is."""
    tiles_of: dict[tuple, tuple[int, ...]] = {}
    independent: dict[tuple, bool] = {}
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if isinstance(child, (PackedLinear, nn.Linear))]
    tiled = 0
    with torch.inference_mode():
        for parent, name, child in targets:
            key = (type(child), child.in_features, child.out_features, child.weight.dtype,
                   child.bias is None)
            if isinstance(child, PackedLinear) and child.small is not None and \
                    child.small.max_rows >= ALL_ROWS:
                if key not in independent:
                    independent[key] = rows_independent(child)
                if independent[key]:
                    continue  # (else oneDNN in tiles, and the layer stack stays off)
            if isinstance(child, PackedLinear):
                matmul = child.packed_matmul
            else:
                def matmul(rows, linear=child):
                    return F.linear(rows, linear.weight, linear.bias)
            if key not in tiles_of:
                tiles_of[key] = agreeing_tiles(matmul, child.in_features, child.weight.dtype)
            setattr(parent, name, RowTiledLinear(child, matmul, tiles_of[key]))
            tiled += 1
    return tiled
