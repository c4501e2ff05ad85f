"""One core's bfloat16 peak: the ceiling the linears and the small GEMM are measured against.

`--unit amx` (default where the CPU has AMX): four sum tiles take `tdpbf16ps` products of two
A and two B tiles, reloaded from one L1-resident address every step (the small GEMM's 2 x 2
blocking with its operands hot), so neither memory nor cache limits the loop; needs a Linux
that grants the tile state. `--unit avx512`: `vdpbf16ps` on 512-bit registers into twelve
independent sums (enough to cover its latency), and for comparison float32 FMAs the same
way. Prints GFLOP/s per core and, at `--ghz`, cycles per instruction.

    python3 -m benchmarks.kernels.bf16_peak [--unit amx|avx512]
    python3 -m benchmarks.kernels.bf16_peak --monitor 30  # each CPU's tile unit at once, per second
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

_CSRC = Path(__file__).resolve().parents[2] / "carpool" / "kernels" / "csrc" / "gemm"
_AMX_SOURCE = r"""
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
NUM_SUMS = 12  # independent sums: enough to cover either instruction's latency
_AVX512_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>

// `steps` rounds of NUM_SUMS independent sums, each updated by `step`; returns their total
// (keeps them live).
template <typename Step>
double independent_sums(int64_t steps, Step step) {
  __m512 acc[NUM_SUMS];
  for (int i = 0; i < NUM_SUMS; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
#pragma GCC unroll 16
    for (int i = 0; i < NUM_SUMS; ++i) acc[i] = step(acc[i]);
  }
  __m512 total = acc[0];
  for (int i = 1; i < NUM_SUMS; ++i) total = _mm512_add_ps(total, acc[i]);
  return _mm512_reduce_add_ps(total);
}

double products(int64_t steps) {
  const __m512bh ones = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // pairs of 1.0
  return independent_sums(steps, [&](__m512 sum) { return _mm512_dpbf16_ps(sum, ones, ones); });
}

double fmas(int64_t steps) {
  const __m512 a = _mm512_set1_ps(1e-9f), b = _mm512_set1_ps(1.f);
  return independent_sums(steps, [&](__m512 sum) { return _mm512_fmadd_ps(a, b, sum); });
}
"""
MONITOR_STEPS = 20_000  # tile-loop steps a burst in --monitor (a few ms)
TILE_FLOP = 2 * 16 * 16 * 32  # a 16 x 32 by 32 x 16 bfloat16 tile product
DPBF16_FLOP = 2 * 32  # 16 lanes, each two bfloat16 products and their sum into float32
FMA_FLOP = 2 * 16


def _amx_module():
    return load_inline("bf16_peak_amx", cpp_sources=_AMX_SOURCE, functions=["products"],
                       extra_include_paths=[str(_CSRC)],
                       extra_cflags=["-O2", "-mamx-tile", "-mamx-bf16", "-mavx512f",
                                     "-DCARPOOL_AMX"])


def _amx_seconds(cpu: int, seconds: float) -> list[float]:
    """On `cpu` alone for `seconds`: the tile loop in bursts of MONITOR_STEPS, each second's
    median GFLOP/s."""
    os.sched_setaffinity(0, {cpu})
    module, per_second = _amx_module(), {}
    end = time.time() + seconds
    while time.time() < end:
        begin = time.perf_counter()
        module.products(MONITOR_STEPS)
        rate = 4 * MONITOR_STEPS * TILE_FLOP / (time.perf_counter() - begin) / 1e9
        per_second.setdefault(int(time.time()), []).append(rate)
    return [statistics.median(rates) for _, rates in sorted(per_second.items())]


def _amx_monitor(seconds: float) -> None:
    """Every CPU this process may use, all at once, one process each: the tile unit's speed
    second by second (BENCHMARKS §44: on a shared VM one vCPU's ran 4-5x slower than the
    other's for seconds at a time)."""
    _amx_module()  # built once, before the processes start
    cpus = sorted(os.sched_getaffinity(0))
    with multiprocessing.get_context("fork").Pool(len(cpus)) as pool:
        rows = pool.starmap(_amx_seconds, [(cpu, seconds) for cpu in cpus])
    print("tdpbf16ps GFLOP/s, each second's median: " + ", ".join(f"CPU {c}" for c in cpus))
    for second in range(min(len(row) for row in rows)):
        print(f"{second:4d}  " + "  ".join(f"{row[second]:7,.0f}" for row in rows))


def _amx(args) -> None:
    if not torch.cpu._is_amx_tile_supported():
        raise SystemExit("this CPU has no AMX tiles (try --unit avx512)")
    if args.monitor:
        _amx_monitor(args.monitor)
        return
    module = _amx_module()
    for _ in range(args.repeats):
        begin = time.perf_counter()
        if module.products(args.steps) == -1:
            raise SystemExit("Linux did not grant the AMX tile state")
        seconds = time.perf_counter() - begin
        count = 4 * args.steps
        print(f"tdpbf16ps: {count * TILE_FLOP / seconds / 1e9:,.0f} GFLOP/s per core, "
              f"{seconds / count * args.ghz * 1e9:.1f} cycles a tile product at {args.ghz} GHz")


def _avx512(args) -> None:
    if "avx512_bf16" not in Path("/proc/cpuinfo").read_text():
        raise SystemExit("this CPU has no AVX512-BF16")
    module = load_inline("bf16_peak_avx512", cpp_sources=_AVX512_SOURCE,
                         functions=["products", "fmas"],
                         extra_cflags=["-O3", "-mavx512f", "-mavx512bf16",
                                       f"-DNUM_SUMS={NUM_SUMS}"])
    steps = args.steps * 10
    for _ in range(args.repeats):
        for name, fn, flop in (("vdpbf16ps", module.products, DPBF16_FLOP),
                               ("vfmadd (float32)", module.fmas, FMA_FLOP)):
            begin = time.perf_counter()
            fn(steps)
            seconds = time.perf_counter() - begin
            count = NUM_SUMS * steps
            print(f"{name}: {count * flop / seconds / 1e9:,.0f} GFLOP/s per core, "
                  f"{seconds / count * args.ghz * 1e9:.2f} cycles an instruction at "
                  f"{args.ghz} GHz")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unit", choices=("amx", "avx512"),
                        default="amx" if torch.cpu._is_amx_tile_supported() else "avx512")
    parser.add_argument("--steps", type=int, default=2_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ghz", type=float, default=3.4, help="clock for the cycles column")
    parser.add_argument("--monitor", type=float, metavar="SECONDS",
                        help="amx: each CPU's tile unit at once, second by second")
    args = parser.parse_args()
    (_amx if args.unit == "amx" else _avx512)(args)


if __name__ == "__main__":
    main()
