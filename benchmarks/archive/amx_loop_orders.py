"""Fed docs/lab/45-both-engines-prefill-phases-side-by-side.md.
(Rerun in docs/lab/46-decode-blocks-in-runs-of-consecutive-ids.md.)

Loop orders for an AMX bfloat16 GEMM at prefill sizes, against oneDNN on one core: what
§45 tried before leaving prefill linears with oneDNN.

Each order is a plain 2 x 2 tile loop (2 A and 2 B tiles feed 4 sums a k step, as
`small_gemm.cpp`'s `amx_tile_2x2`) over `pack_bf16_weight`'s packed weight, differing only
in which operand stays in cache:

- `a-resident GP`: each 32 rows of x (in L1) meet GP column pairs (their weight in L2),
  full K a sum;
- `k-chunks MB KC GP`: a row block of MB rows meets each of GP pairs K in chunks of KC k steps,
  so a pair's B chunk stays in L1 over the block's rows, the sums going through an L1 buffer
  between chunks;
- `b-prefetch GP D`: `a-resident` with the B tiles D k steps ahead prefetched into L1;
- `a-packed GP`: `a-resident` with the 32 rows first copied into contiguous 1 KB A tiles.

Rows a multiple of 32, one thread (pin it: `taskset -c 1`). Every round times oneDNN's
packed matmul, the small GEMM as it is (`small_gemm_bf16(amx=True)`) and each order once, in
a shuffled order; prints, per shape, oneDNN's GFLOP/s and the median over rounds of each one's
time / oneDNN's time in the same round (the host moves the tile unit's speed between phases
seconds long; the ratio within a round does not move with them).

    taskset -c 1 python3 -m benchmarks.archive.amx_loop_orders --rows 4096 \\
        --orders "a-resident 8" "k-chunks 128 6 28" "k-chunks 64 4 28" "b-prefetch 8 2" \\
        "a-packed 16"
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

from carpool import kernels as cpu_kernels

SHAPES = [(576, 3072), (576, 960), (1536, 576), (576, 576)]  # (K, N) of the 135M model
ORDERS = {"a-resident": 0, "k-chunks": 1, "b-prefetch": 2, "a-packed": 3}
_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include "gemm/amx_tiles.h"

// The 4 sums (16 x 16 float32 each) of rows r, r + 16 by column blocks b, b + 1, as stored.
CARPOOL_AMX_TARGET static void store_rows(const float* c, uint16_t* y, int64_t n) {
  for (int r = 0; r < 32; ++r) {
    const float* src = c + (r / 16) * 512 + (r % 16) * 16;
    _mm256_storeu_si256((__m256i*)(y + r * n), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(src)));
    _mm256_storeu_si256((__m256i*)(y + r * n + 16),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(src + 256)));
  }
}

// k steps [j0, j1) of the 2 x 2 tiles: A rows at a (a_bytes apart, k step j at + 32 j), the two
// B blocks at w and w + bs (k step j at + 512 j); pf >= 0: prefetch B pf steps ahead from
// the stream at w (past j1: the next pair's at wn).
CARPOOL_AMX_TARGET static void k_steps(const uint16_t* a, int64_t a_bytes, int64_t a_step,
                                        const uint16_t* w, const uint16_t* wn, int64_t bs,
                                        int64_t j0, int64_t j1, int64_t pf) {
  for (int64_t j = j0; j < j1; ++j) {
    if (pf > 0) {
      const int64_t jp = j + pf;
      const char* p = (const char*)(jp < j1 ? w + jp * 512 : wn + (jp - j1) * 512);
      for (int l = 0; l < 16; ++l) {
        _mm_prefetch(p + 64 * l, _MM_HINT_T0);
        _mm_prefetch(p + 2 * bs + 64 * l, _MM_HINT_T0);
      }
    }
    _tile_loadd(4, a + j * a_step, a_bytes);
    _tile_loadd(6, w + j * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, w + bs + j * 512, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a + 16 * (a_bytes / 2) + j * a_step, a_bytes);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

CARPOOL_AMX_TARGET static void store_sums(float* c) {
  _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64);
  _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
}

CARPOOL_AMX_TARGET static void zero_sums() {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
}

// y [M, N] = x [M, K] w^T; order 0-3 as the driver's ORDERS, its numbers mb, kc, gp, pf.
CARPOOL_AMX_TARGET void gemm(torch::Tensor xt, torch::Tensor wt, torch::Tensor yt, int64_t order,
                             int64_t mb, int64_t kc, int64_t gp, int64_t pf) {
  const int64_t M = xt.size(0), K = xt.size(1), N = yt.size(1);
  const auto* x = (const uint16_t*)xt.data_ptr();
  const auto* w = (const uint16_t*)wt.data_ptr();
  auto* y = (uint16_t*)yt.data_ptr();
  const int64_t bs = K * 16, ks = K / 32, pairs = N / 32;
  TORCH_CHECK(M % 32 == 0 && N % 32 == 0 && K % 32 == 0 && K <= 4096, "shapes");
  configure_tiles();
  alignas(64) float c[1024];
  alignas(64) static float sums[64][1024];           // k-chunks: mb / 32 <= 64 row pairs
  alignas(64) static uint16_t packed_a[2 * 4096 * 16];  // a-packed: 32 rows of K
  for (int64_t g0 = 0; g0 < pairs; g0 += gp) {
    const int64_t g1 = std::min(pairs, g0 + gp);
    if (order == 1) {  // k-chunks
      for (int64_t r0 = 0; r0 < M; r0 += mb) {
        const int64_t rows = std::min(mb, M - r0);
        TORCH_CHECK(rows / 32 <= 64, "k-chunks: MB up to 2048");
        for (int64_t p = g0; p < g1; ++p) {
          const uint16_t* wp = w + 2 * p * bs;
          for (int64_t k0 = 0; k0 < ks; k0 += kc) {
            const int64_t k1 = std::min(ks, k0 + kc);
            for (int64_t t = 0; t < rows / 32; ++t) {
              float* s = sums[t];
              if (k0 == 0) zero_sums();
              else { _tile_loadd(0, s, 64); _tile_loadd(1, s + 256, 64);
                     _tile_loadd(2, s + 512, 64); _tile_loadd(3, s + 768, 64); }
              k_steps(x + (r0 + 32 * t) * K, K * 2, 32, wp, wp, bs, k0, k1, 0);
              store_sums(k1 == ks ? c : s);
              if (k1 == ks) store_rows(c, y + (r0 + 32 * t) * N + 32 * p, N);
            }
          }
        }
      }
      continue;
    }
    for (int64_t r0 = 0; r0 < M; r0 += 32) {  // a-resident and its variants
      const uint16_t* a = x + r0 * K;
      int64_t a_bytes = K * 2, a_step = 32;
      if (order == 3) {  // 32 rows into contiguous tiles: k step j's two at + 1024 j
        for (int64_t j = 0; j < ks; ++j)
          for (int r = 0; r < 32; ++r)
            _mm512_store_si512(packed_a + (j * 32 + r) * 32,
                               _mm512_loadu_si512(a + r * K + j * 32));
        a = packed_a; a_bytes = 64; a_step = 1024;
      }
      for (int64_t p = g0; p < g1; ++p) {
        const uint16_t* wp = w + 2 * p * bs;
        const uint16_t* wn = w + 2 * (p + 1 < g1 ? p + 1 : g0) * bs;
        zero_sums();
        k_steps(a, a_bytes, a_step, wp, wn, bs, 0, ks, order == 2 ? pf : 0);
        store_sums(c);
        store_rows(c, y + r0 * N + 32 * p, N);
      }
    }
  }
  release_tiles();
}
"""


def build():
    csrc = Path(cpu_kernels.__file__).parent / "csrc"
    flags = ["-O3", "-DCARPOOL_AMX", "-mavx512bf16", *cpu_kernels.loader.CAPABILITY_FLAGS["AVX512"]]
    return load_inline("amx_loop_orders", cpp_sources=_SOURCE, functions=["gemm"],
                       extra_include_paths=[str(csrc)], extra_cflags=flags)


def parse_order(text: str) -> tuple[str, tuple[int, int, int, int, int]]:
    """'k-chunks 128 6 28' -> (the text, (order, mb, kc, gp, pf))."""
    name, *numbers = text.split()
    values = [int(v) for v in numbers]
    if name == "k-chunks" and len(values) == 3:
        return text, (1, values[0], values[1], values[2], 0)
    if name in ("a-resident", "a-packed") and len(values) == 1:
        return text, (ORDERS[name], 0, 0, values[0], 0)
    if name == "b-prefetch" and len(values) == 2:
        return text, (2, 0, 0, values[0], values[1])
    raise SystemExit(f"bad order {text!r}: a-resident GP | k-chunks MB KC GP | b-prefetch GP D"
                     " | a-packed GP")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--orders", nargs="+", default=["a-resident 8", "k-chunks 128 6 28"])
    args = parser.parse_args()
    if args.rows % 32:
        raise SystemExit("--rows must be a multiple of 32")
    torch.set_num_threads(1)
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.has_amx():
        raise SystemExit("needs the compiled kernels with AMX")
    module = build()
    orders = [parse_order(text) for text in args.orders]
    torch.manual_seed(0)
    for k, n in SHAPES:
        time_shape(module, kernels, k, n, args.rows, args.rounds, orders)


def time_shape(module, kernels, k: int, n: int, rows: int, rounds: int, orders) -> None:
    """One shape: check every way against oneDNN, time them in shuffled rounds, print."""
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, k).to(torch.bfloat16)
    packed, onednn = kernels.pack_bf16_weight(w), torch.ops.mkldnn._reorder_linear_weight(w)
    fns = {"oneDNN": lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
           "small GEMM now": lambda: kernels.small_gemm_bf16(x, packed, n, None, amx=True)}
    for text, numbers in orders:
        out = torch.empty(rows, n, dtype=torch.bfloat16)
        fns[text] = (lambda out=out, numbers=numbers:
                     (module.gemm(x, packed, out, *numbers), out)[1])
    reference = fns["oneDNN"]().float()
    for name, fn in fns.items():
        assert (fn().float() - reference).abs().max() < 0.1, name
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for _ in range(rounds):
        random.shuffle(names)
        for name in names:
            begin = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - begin)
    flop = 2 * rows * k * n
    ratios = {name: statistics.median(a / b for a, b in zip(times[name], times["oneDNN"]))
              for name in fns if name != "oneDNN"}
    print(f"{k} x {n}, {rows} rows: oneDNN "
          f"{flop / statistics.median(times['oneDNN']) / 1e9:.0f} GFLOP/s; time / oneDNN's: "
          + ", ".join(f"{name} {ratio:.2f}" for name, ratio in ratios.items()), flush=True)

if __name__ == "__main__":
    main()
