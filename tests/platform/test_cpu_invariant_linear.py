"""Batch-invariant linears: a row's result is bitwise the same however many rows share its
call, packed by oneDNN or not; the larger tiles are used only where they agree."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from carpool.platform.cpu_invariant_linear import (REFERENCE_ROWS, TILES, RowTiledLinear,
                                                   agreeing_tiles, in_row_tiles, tile_linears)
from carpool.platform.cpu_linear import pack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "F.linear"])
def test_a_row_is_the_same_whatever_the_row_count(packed, dtype):
    """K = 1536: oneDNN's 1-row path sums in another order than its many-row kernel here,
    and MKL's float32 sgemm at every row count; tiled, row counts 1 to 300 (every tile size,
    the row at the end, after padding or not) give the row's bits alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1536, 96, bias=True)).to(dtype)
    reference = model[0].weight.detach().float(), model[0].bias.detach().float()
    if packed:
        pack_linears(model)
    assert tile_linears(model) == 1 and isinstance(model[0], RowTiledLinear)
    x = torch.randn(300, 1536, dtype=dtype)
    with torch.inference_mode():
        alone = model(x[:1])
        for rows in (2, 3, 5, 9, 16, 17, 63, 64, 65, 255, 256, 257, 300):
            batch = torch.cat([x[1:rows], x[:1]])  # the row last, after rows - 1 others
            assert torch.equal(model(batch)[-1:], alone), rows
        expected = x.float() @ reference[0].T + reference[1]
        torch.testing.assert_close(model(x).float(), expected, atol=2e-2, rtol=2e-2)


def test_row_tiles_are_cut_largest_first_and_the_rest_padded_once():
    weight = torch.randn(8, 4)
    calls = []

    def matmul(rows):
        calls.append(rows.shape[0])
        return rows @ weight.T

    for num_rows, expected in ((300, [256, 16, 16, 16]),  # 256 + 2 x 16 + 12 padded to 16
                               (261, [256, 8]),  # 5 rows padded to 8, not cut into 4 + 1
                               (1, [2]), (80, [64, 16]), (143, [64, 64, 16])):
        calls.clear()
        x = torch.randn(num_rows, 4)
        out = in_row_tiles(x, (256, 64, 16, 8, 4, 2), matmul)
        assert calls == expected, num_rows
        torch.testing.assert_close(out, x @ weight.T)
    assert REFERENCE_ROWS in TILES and list(TILES) == sorted(TILES, reverse=True)


def test_a_tile_size_that_sums_in_another_order_is_not_used():
    """A matmul exact to float32 at every row count (float64, rounded) keeps every size; one
    that sums over K backwards in float32 for 64- and 2-row calls loses those two."""
    weight = torch.randn(96, 512, dtype=torch.float64)

    def exact(rows):
        return (rows.double() @ weight.T).float()

    def matmul(rows):
        if rows.shape[0] in (64, 2):
            return rows.flip(-1) @ weight.float().flip(-1).T
        return exact(rows)

    assert agreeing_tiles(exact, 512, torch.float32) == TILES
    assert agreeing_tiles(matmul, 512, torch.float32) == tuple(r for r in TILES if r not in (64, 2))
