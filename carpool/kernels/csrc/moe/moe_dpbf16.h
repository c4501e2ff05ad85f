// The bfloat16 experts on AVX512-BF16 builds (moe_experts.cpp's fast path): every expert's
// weights packed once, as the small GEMMs pack a linear (gemm/small_gemm.cpp), into blocks of
// 16 output columns whose rows hold (k, k + 1) pairs, so one `vdpbf16ps` multiplies a whole
// block by a broadcast pair of one row and one vector holds 16 outputs: no output ever ends
// in a horizontal sum across lanes, which at one row cost as many instructions as the
// multiplies themselves (docs/lab/56-mixture-of-experts.md).
//
//   gate_up: [E][I / 16][gate, up][H / 2][16][2] (a block's gate then its up columns: one
//            work item streams both halves of its SiLU from one stretch)
//   down:    [E][ceil(H / 16)][I / 2][16][2]
//
// H is zero-padded to even (x gets a zero column to match), I to whole blocks of 16 (a zero
// gate column gives silu(0) * 0 = 0; the padded down rows are zero), the down's outputs to
// whole blocks (the extra columns are never read). Each output is one lane's sum over the
// pairs in k order whatever the tile, so a row's result never depends on the other rows.

#pragma once

#ifdef CARPOOL_AVX512_BF16
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "moe/moe_routing.h"

namespace carpool_moe {
namespace {

constexpr int64_t kLanes = 16;  // output columns per block (one float32 register)
constexpr int kMaxRows = 8;     // rows per tile: 8 x 2 blocks of accumulators
// An item's tiles prefetch the thread's next item's weight into L2 as they run, so that it
// arrives while they multiply instead of after: from a few rows a step is both a stream over
// most experts' weights and real arithmetic, and without it the two took about their sum
// rather than their maximum; the stream jumps from expert to expert, where the hardware
// prefetcher starts over. Unlike the small GEMMs' one contiguous stream (which prefetch from
// 3 rows only, gemm/small_gemm.cpp), one row lost nothing by it here (lab 56).

// The cache lines of the next item's weight, issued a few per pair step of a tile.
struct Ahead {
  const char* lines = nullptr;
  int64_t count = 0, per_step = 0;
};

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// w [rows, K] (K even) -> [ceil(rows / 16)][K / 2][16][2], rows beyond `rows` zero.
at::Tensor pairs_in_blocks(const at::Tensor& w) {
  const int64_t rows = w.size(0), K = w.size(1);
  const int64_t padded = round_up(rows, kLanes);
  return at::constant_pad_nd(w, {0, 0, 0, padded - rows})
      .view({padded / kLanes, kLanes, K / 2, 2})
      .permute({0, 2, 1, 3})
      .contiguous();
}

std::tuple<at::Tensor, at::Tensor> pack_dpbf16(const at::Tensor& gate_up, const at::Tensor& down) {
  const int64_t E = gate_up.size(0), I = gate_up.size(1) / 2, H = gate_up.size(2);
  const int64_t Hp = round_up(H, 2), Ip = round_up(I, kLanes), Hy = round_up(H, kLanes);
  const at::Tensor gu = at::constant_pad_nd(gate_up, {0, Hp - H});
  std::vector<at::Tensor> gate_ups, downs;
  for (int64_t e = 0; e < E; ++e) {
    // [I/16][H/2][16][2] each half, then interleaved by block: [I/16][2][H/2][16][2]
    const at::Tensor gate = pairs_in_blocks(gu[e].narrow(0, 0, I));
    const at::Tensor up = pairs_in_blocks(gu[e].narrow(0, I, I));
    gate_ups.push_back(at::stack({gate, up}, 1));
    downs.push_back(pairs_in_blocks(at::constant_pad_nd(down[e], {0, Ip - I})));
  }
  return {at::stack(gate_ups).reshape({E, 2 * Ip, Hp}).contiguous(),
          at::stack(downs).reshape({E, Hy, Ip}).contiguous()};
}

// out[r * ldo + b * 16 + j] = sum over pairs p of x[r][2p..2p+1] . w[b][p][j], for R rows
// (pointers, each at least 2 * pairs values) and B blocks `w_stride` apart.
// Never inlined: one instance per shape keeps its accumulators in registers.
template <int R, int B>
__attribute__((noinline)) void dp_tile(const uint16_t* const* x, const uint16_t* w,
                                       int64_t w_stride, int64_t pairs, float* out,
                                       int64_t ldo, Ahead ahead) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    for (int64_t i = 0; i < ahead.per_step && ahead.count > 0; ++i, --ahead.count) {
      _mm_prefetch(ahead.lines, _MM_HINT_T1);
      ahead.lines += 64;
    }
    __m512i wv[B];
    for (int b = 0; b < B; ++b)
      wv[b] = _mm512_loadu_si512(w + b * w_stride + p * 2 * kLanes);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x[r] + 2 * p, sizeof(pair));
      const __m512i xv = _mm512_set1_epi32(pair);
      for (int b = 0; b < B; ++b)
        acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)wv[b], (__m512bh)xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) _mm512_storeu_ps(out + r * ldo + b * kLanes, acc[r][b]);
}

template <int B>
void dp_rows(int rows, const uint16_t* const* x, const uint16_t* w, int64_t w_stride,
             int64_t pairs, float* out, int64_t ldo, Ahead ahead) {
  switch (rows) {
    case 1: dp_tile<1, B>(x, w, w_stride, pairs, out, ldo, ahead); break;
    case 2: dp_tile<2, B>(x, w, w_stride, pairs, out, ldo, ahead); break;
    case 3: dp_tile<3, B>(x, w, w_stride, pairs, out, ldo, ahead); break;
    case 4: dp_tile<4, B>(x, w, w_stride, pairs, out, ldo, ahead); break;
    case 5: dp_tile<5, B>(x, w, w_stride, pairs, out, ldo, ahead); break;
    case 6: dp_tile<6, B>(x, w, w_stride, pairs, out, ldo, ahead); break;
    case 7: dp_tile<7, B>(x, w, w_stride, pairs, out, ldo, ahead); break;
    default: dp_tile<8, B>(x, w, w_stride, pairs, out, ldo, ahead); break;
  }
}

// The row tiles of expert e's pairs [begin, end): as even as they can be (9 rows as 5 + 4),
// f(first pair, rows, ahead): the next item's `bytes` at `next` (null: none) shared out
// over the tiles' pair steps.
template <typename F>
void row_tiles(int64_t begin, int64_t end, const uint16_t* next, int64_t bytes, int64_t pairs,
               const F& f) {
  const int64_t n = end - begin, tiles = (n + kMaxRows - 1) / kMaxRows;
  const int64_t lines = next == nullptr ? 0 : bytes / 64;
  const int64_t per_step = (lines + tiles * pairs - 1) / (tiles * pairs);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t lo = begin + n * t / tiles, hi = begin + n * (t + 1) / tiles;
    const int64_t first = lines * t / tiles, count = lines * (t + 1) / tiles - first;
    f(lo, static_cast<int>(hi - lo),
      Ahead{reinterpret_cast<const char*>(next) + first * 64, count, per_step});
  }
}

// y [pairs, Hy] float32: each sorted pair's expert output; act [pairs, Ip] bfloat16 scratch.
// x: bfloat16 rows of Hp (even) values.
void run_dpbf16(const at::BFloat16* x, int64_t Hp, const at::BFloat16* gate_up,
                const at::BFloat16* down, int64_t Ip, int64_t Hy, const Routing& r,
                at::BFloat16* act, float* y) {
  using Vec = at::vec::Vectorized<float>;
  static_assert(Vec::size() == kLanes, "an AVX-512 float vector holds one block");
  const auto* xs = reinterpret_cast<const uint16_t*>(x);
  const auto* gu = reinterpret_cast<const uint16_t*>(gate_up);
  const auto* dn = reinterpret_cast<const uint16_t*>(down);
  auto* a16 = reinterpret_cast<uint16_t*>(act);
  const int64_t blocks = Ip / kLanes, active = static_cast<int64_t>(r.active.size());
  const int64_t block_stride = Hp / 2 * 2 * kLanes;  // one block of H/2 pairs
  // gate/up: items (expert, block of 16 intermediate columns), expert by expert, so a
  // thread's share streams through contiguous weights.
  at::parallel_for(0, blocks * active, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float tile[kMaxRows * 2 * kLanes];
    for (int64_t item = begin; item < end; ++item) {
      auto weight = [&](int64_t it) {
        return gu + (r.active[it / blocks] * blocks + it % blocks) * 2 * block_stride;
      };
      const int64_t e = r.active[item / blocks], b = item % blocks;
      const uint16_t* w = weight(item);
      const uint16_t* next = item + 1 < end ? weight(item + 1) : nullptr;
      row_tiles(r.starts[e], r.starts[e + 1], next, 2 * block_stride * 2, Hp / 2,
                [&](int64_t p, int rows, Ahead ahead) {
        const uint16_t* rs[kMaxRows];
        for (int i = 0; i < rows; ++i) rs[i] = xs + r.rows[p + i] * Hp;
        dp_rows<2>(rows, rs, w, block_stride, Hp / 2, tile, 2 * kLanes, ahead);
        for (int i = 0; i < rows; ++i) {
          const Vec g = Vec::loadu(tile + i * 2 * kLanes);
          const Vec u = Vec::loadu(tile + i * 2 * kLanes + kLanes);
          const Vec s = g / (Vec(1.f) + g.neg().exp()) * u;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(a16 + (p + i) * Ip + b * kLanes),
                              (__m256i)_mm512_cvtneps_pbh(s));
        }
      });
    }
  });
  // down: items (expert, two blocks of 16 outputs) over the act rows of its pairs.
  const int64_t out_blocks = Hy / kLanes, groups = (out_blocks + 1) / 2;
  const int64_t down_stride = Ip / 2 * 2 * kLanes;
  at::parallel_for(0, groups * active, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      auto weight = [&](int64_t it) {
        return dn + (r.active[it / groups] * out_blocks + (it % groups) * 2) * down_stride;
      };
      const int64_t e = r.active[item / groups], b0 = (item % groups) * 2;
      const int nb = static_cast<int>(std::min<int64_t>(2, out_blocks - b0));
      const uint16_t* w = weight(item);
      // the next item's two blocks (one, where it is an expert's odd last block: the
      // prefetch may then reach one block past it: prefetches never fault)
      const uint16_t* next = item + 1 < end ? weight(item + 1) : nullptr;
      row_tiles(r.starts[e], r.starts[e + 1], next, 2 * down_stride * 2, Ip / 2,
                [&](int64_t p, int rows, Ahead ahead) {
        const uint16_t* rs[kMaxRows];
        for (int i = 0; i < rows; ++i) rs[i] = a16 + (p + i) * Ip;
        float* out = y + p * Hy + b0 * kLanes;
        if (nb == 2)
          dp_rows<2>(rows, rs, w, down_stride, Ip / 2, out, Hy, ahead);
        else
          dp_rows<1>(rows, rs, w, down_stride, Ip / 2, out, Hy, ahead);
      });
    }
  });
}

}  // namespace
}  // namespace carpool_moe
#endif
