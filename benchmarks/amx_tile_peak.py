"""The AMX tile unit's bfloat16 peak on one core: the ceiling the small GEMM is measured against.

Four sum tiles take `tdpbf16ps` products of two A and two B tiles, reloaded from one
L1-resident address every step (the small GEMM's 2 x 2 blocking with its operands hot), so
neither memory nor cache limits the loop. Prints TFLOP/s per core and cycles a product at
`--ghz`. Needs a CPU with AMX and a Linux that grants the tile state.

    python3 benchmarks/amx_tile_peak.py
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

_CSRC = Path(__file__).resolve().parent.parent / "carpool" / "attention" / "csrc"
_SOURCE = r"""
#include <torch/extension.h>
#include "amx_tiles.h"

// -1 where the tile state is not granted; else the first sum (keeps the products live).
CARPOOL_AMX_TARGET double products(int64_t steps) {
  if (!amx_usable()) return -1;
  configure_tiles();
  alignas(64) static uint16_t a[2][16 * 32] = {}, b[2][16 * 32] = {};
  alignas(64) static float c[16 * 16];
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t i = 0; i < steps; ++i) {
    _tile_loadd(4, a[0], 64); _tile_loadd(5, a[1], 64);
    _tile_loadd(6, b[0], 64); _tile_loadd(7, b[1], 64);
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  release_tiles();
  return c[0];
}
"""
FLOP_PER_PRODUCT = 2 * 16 * 16 * 32  # a 16 x 32 by 32 x 16 bfloat16 tile product


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ghz", type=float, default=3.4, help="clock for the cycles column")
    args = parser.parse_args()
    if not torch.cpu._is_amx_tile_supported():
        raise SystemExit("this CPU has no AMX tiles")
    module = load_inline("amx_tile_peak", cpp_sources=_SOURCE, functions=["products"],
                         extra_include_paths=[str(_CSRC)],
                         extra_cflags=["-O2", "-mamx-tile", "-mamx-bf16", "-mavx512f",
                                       "-DCARPOOL_AMX"])
    for _ in range(args.repeats):
        begin = time.perf_counter()
        if module.products(args.steps) == -1:
            raise SystemExit("Linux did not grant the AMX tile state")
        seconds = time.perf_counter() - begin
        num_products = 4 * args.steps
        print(f"{num_products * FLOP_PER_PRODUCT / seconds / 1e12:.2f} TFLOP/s per core, "
              f"{seconds / num_products * args.ghz * 1e9:.1f} cycles a product at {args.ghz} GHz")


if __name__ == "__main__":
    main()
