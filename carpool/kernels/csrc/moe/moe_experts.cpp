// A mixture-of-experts layer's experts in one call: a step's (row, expert) pairs sorted by
// expert, one grouped GEMM over every expert's gate/up with silu(gate) * up fused into its
// tiles, one over the downs, and each row's weighted sum of its experts' outputs.
// Work items run expert by expert, so each thread streams through contiguous weights.
//
// Each output element is one dot product whose order over K is fixed (vector lanes in K
// order, then one fixed horizontal sum) whatever tile it falls in, and each row sums its
// experts in ascending expert order: a row's result never depends on the other rows of the
// step (the batch-invariant mode relies on it). Sums run in float32. bfloat16 experts on
// AVX512-BF16 builds take moe_dpbf16.h: the small GEMMs' packed layout, 16 outputs a vector,
// vdpbf16ps on x as it is and silu(gate) * up rounded to bfloat16 as Hugging Face's bfloat16
// experts round it. Elsewhere (below) the weights are widened to float32 in registers
// against float32 rows.
//
// There pack_moe_experts lays the gate/up weights out once at load: per block of kBlock
// intermediate rows, the block's gate rows then its up rows, so one tile reads both halves
// of its SiLU from one stretch; the intermediate size is zero-padded to whole blocks (a zero
// gate row gives silu(0) * 0 = 0, and the padded down columns are zero too).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#ifdef CARPOOL_AVX512_BF16
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "moe/moe_dpbf16.h"
#include "moe/moe_routing.h"

namespace carpool_moe {
namespace {

using Vec = at::vec::Vectorized<float>;
using VecB = at::vec::Vectorized<at::BFloat16>;
constexpr int64_t kBlock = 8;  // intermediate rows per packed gate/up block
constexpr int64_t kStep = 2 * Vec::size();  // K per inner step: one bfloat16 vector
static_assert(VecB::size() == kStep, "a bfloat16 vector widens to two float vectors");
// Rows per tile: 4 x 4 accumulators fit AVX-512's 32 registers; AVX2's 16 hold 2 x 4.
constexpr int kRows = Vec::size() >= 16 ? 4 : 2;
constexpr int kCols = 4;  // weight rows per tile

// Two float vectors of K from w[k...], `count` of them real (the rest zero).
template <typename W>
inline void load_pair(const W* w, int64_t count, Vec& lo, Vec& hi) {
  if constexpr (std::is_same_v<W, float>) {
    if (count >= kStep) {
      lo = Vec::loadu(w);
      hi = Vec::loadu(w + Vec::size());
    } else {
      const int64_t n0 = std::min<int64_t>(count, Vec::size());
      lo = Vec::loadu(w, n0);
      hi = count > Vec::size() ? Vec::loadu(w + Vec::size(), count - Vec::size()) : Vec(0.f);
    }
  } else {
    const VecB b = count >= kStep ? VecB::loadu(w) : VecB::loadu(w, count);
    std::tie(lo, hi) = at::vec::convert_to_float<at::BFloat16>(b);
  }
}

// out[r * ldo + c] = dot(x[r], w[c * ldw ...]) over K, for R rows and C weight rows. The
// weight rows after these (the next tile's, `ahead` of them) are prefetched as it goes: a
// decode reads each expert's weights once, from memory.
template <typename W, int R, int C>
void dot_tile(const float* const* x, const W* w, int64_t ldw, int64_t K, float* out,
              int64_t ldo, int64_t ahead) {
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Vec(0.f);
  for (int64_t k = 0; k < K; k += kStep) {
    const int64_t count = std::min<int64_t>(kStep, K - k);
    Vec xl[R], xh[R];
    for (int r = 0; r < R; ++r) load_pair<float>(x[r] + k, count, xl[r], xh[r]);
    for (int c = 0; c < C; ++c) {
      Vec wl, wh;
      const W* row = w + c * ldw + k;
      if (c < ahead) {
        __builtin_prefetch(row + C * ldw);
        if constexpr (sizeof(W) == 4) __builtin_prefetch(row + C * ldw + Vec::size());
      }
      load_pair<W>(row, count, wl, wh);
      for (int r = 0; r < R; ++r) {
        acc[r][c] = at::vec::fmadd(xl[r], wl, acc[r][c]);
        acc[r][c] = at::vec::fmadd(xh[r], wh, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      out[r * ldo + c] = at::vec::vec_reduce_all<float>(
          [](const Vec& a, const Vec& b) { return a + b; }, acc[r][c]);
}

#ifdef CARPOOL_AVX512_BF16
constexpr bool kDpBf16 = true;
// The bfloat16 tile: 32 of K per step, both sides bfloat16, float32 lanes of pair sums.
template <int R, int C>
void dot_tile_bf16(const at::BFloat16* const* x, const at::BFloat16* w, int64_t ldw,
                   int64_t K, float* out, int64_t ldo, int64_t ahead) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t count = std::min<int64_t>(32, K - k);
    const __mmask32 mask = count == 32 ? ~__mmask32{0} : (__mmask32{1} << count) - 1;
    __m512i xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_maskz_loadu_epi16(mask, x[r] + k);
    for (int c = 0; c < C; ++c) {
      const at::BFloat16* row = w + c * ldw + k;
      if (c < ahead) __builtin_prefetch(row + C * ldw);
      const __m512i wv = _mm512_maskz_loadu_epi16(mask, row);
      for (int r = 0; r < R; ++r)
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)xv[r], (__m512bh)wv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = _mm512_reduce_add_ps(acc[r][c]);
}
#else
constexpr bool kDpBf16 = false;
#endif

// What the rows a weight type multiplies are held in: bfloat16 against bfloat16 weights on
// AVX512-BF16 builds, else float32.
template <typename W>
using RowT = std::conditional_t<kDpBf16 && std::is_same_v<W, at::BFloat16>, at::BFloat16, float>;

template <typename W, int C>
void dot_rows(int rows, const RowT<W>* const* x, const W* w, int64_t ldw, int64_t K, float* out,
              int64_t ldo, int64_t ahead) {
#ifdef CARPOOL_AVX512_BF16
  if constexpr (std::is_same_v<RowT<W>, at::BFloat16>) {
    switch (rows) {
      case 1: dot_tile_bf16<1, C>(x, w, ldw, K, out, ldo, ahead); break;
      case 2: dot_tile_bf16<2, C>(x, w, ldw, K, out, ldo, ahead); break;
      case 3: dot_tile_bf16<3, C>(x, w, ldw, K, out, ldo, ahead); break;
      default: dot_tile_bf16<4, C>(x, w, ldw, K, out, ldo, ahead); break;
    }
    return;
  }
#endif
  if constexpr (std::is_same_v<RowT<W>, float>) switch (rows) {
    case 1: dot_tile<W, 1, C>(x, w, ldw, K, out, ldo, ahead); break;
    case 2: dot_tile<W, 2, C>(x, w, ldw, K, out, ldo, ahead); break;
    case 3: if constexpr (kRows >= 3) dot_tile<W, 3, C>(x, w, ldw, K, out, ldo, ahead); break;
    default: if constexpr (kRows >= 4) dot_tile<W, 4, C>(x, w, ldw, K, out, ldo, ahead); break;
  }
}

// rows x cols dot products (rows <= kRows, cols <= kCols), prefetching `ahead` weight rows
// past the last (0: none).
template <typename W>
void dot(int rows, int cols, const RowT<W>* const* x, const W* w, int64_t ldw, int64_t K,
         float* out, int64_t ldo, int64_t ahead) {
  switch (cols) {
    case 1: dot_rows<W, 1>(rows, x, w, ldw, K, out, ldo, ahead); break;
    case 2: dot_rows<W, 2>(rows, x, w, ldw, K, out, ldo, ahead); break;
    case 3: dot_rows<W, 3>(rows, x, w, ldw, K, out, ldo, ahead); break;
    default: dot_rows<W, 4>(rows, x, w, ldw, K, out, ldo, ahead); break;
  }
}

template <typename W>
void run(const RowT<W>* x, int64_t H, const W* gate_up, const W* down, int64_t I,
         const Routing& r, RowT<W>* act, float* y) {
  const int64_t blocks = I / kBlock, active = static_cast<int64_t>(r.active.size());
  // gate/up: items expert by expert, so a thread's share streams through contiguous weights
  // (its last tile prefetching the next block's rows).
  at::parallel_for(0, blocks * active, 1, [&](int64_t begin, int64_t end) {
    float tile[kRows * 2 * kBlock];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = r.active[item / blocks], b = item % blocks;
      const W* w = gate_up + (e * 2 * I + b * 2 * kBlock) * H;
      for (int64_t p = r.starts[e]; p < r.starts[e + 1]; p += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, r.starts[e + 1] - p));
        const RowT<W>* xs[kRows];
        for (int i = 0; i < rows; ++i) xs[i] = x + r.rows[p + i] * H;
        const bool first = p == r.starts[e];  // later row tiles find the block in cache
        for (int64_t c = 0; c < 2 * kBlock; c += kCols)
          dot<W>(rows, kCols, xs, w + c * H, H, H, tile + c, 2 * kBlock, first ? kCols : 0);
        for (int i = 0; i < rows; ++i) {
          RowT<W>* a = act + (p + i) * I + b * kBlock;
          const float* t = tile + i * 2 * kBlock;
          for (int64_t j = 0; j < kBlock; ++j) {
            const float g = t[j];
            a[j] = static_cast<RowT<W>>(g / (1.f + std::exp(-g)) * t[kBlock + j]);
          }
        }
      }
    }
  });
  // down: [pairs, I] x down_e [H, I] -> y [pairs, H], in blocks of 4 * kCols outputs.
  constexpr int64_t kOut = 4 * kCols;
  const int64_t out_blocks = (H + kOut - 1) / kOut;
  at::parallel_for(0, out_blocks * active, 1, [&](int64_t begin, int64_t end) {
    float tile[kRows * kOut];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = r.active[item / out_blocks], h0 = (item % out_blocks) * kOut;
      const int64_t width = std::min(kOut, H - h0);
      const W* w = down + (e * H + h0) * I;
      for (int64_t p = r.starts[e]; p < r.starts[e + 1]; p += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, r.starts[e + 1] - p));
        const RowT<W>* as[kRows];
        for (int i = 0; i < rows; ++i) as[i] = act + (p + i) * I;
        const bool first = p == r.starts[e];
        for (int64_t c = 0; c < width; c += kCols) {
          const int cols = static_cast<int>(std::min<int64_t>(kCols, width - c));
          const int64_t ahead = !first ? 0 : h0 + c + 2 * cols <= H ? cols : 0;
          dot<W>(rows, cols, as, w + c * I, I, I, tile + c, kOut, ahead);
        }
        for (int i = 0; i < rows; ++i)
          std::copy(tile + i * kOut, tile + i * kOut + width, y + (p + i) * H + h0);
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> pack_moe_experts(const at::Tensor& gate_up,
                                                    const at::Tensor& down) {
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3, "pack_moe_experts: gate_up [E, 2I, H] "
              "and down [E, H, I]");
  const int64_t E = gate_up.size(0), I = gate_up.size(1) / 2, H = gate_up.size(2);
  TORCH_CHECK(gate_up.size(1) == 2 * I && down.size(0) == E && down.size(1) == H &&
                  down.size(2) == I, "pack_moe_experts: shapes ", gate_up.sizes(), " and ",
              down.sizes(), " do not match");
  TORCH_CHECK(gate_up.scalar_type() == down.scalar_type() &&
                  (gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16),
              "pack_moe_experts: float32 or bfloat16 weights of one dtype");
#ifdef CARPOOL_AVX512_BF16
  if (gate_up.scalar_type() == at::kBFloat16) return pack_dpbf16(gate_up, down);
#endif
  const int64_t padded = (I + kBlock - 1) / kBlock * kBlock;
  auto half = [&](int64_t start) {  // [E, I, H] -> [E, padded / kBlock, kBlock, H]
    return at::constant_pad_nd(gate_up.narrow(1, start, I), {0, 0, 0, padded - I})
        .view({E, padded / kBlock, kBlock, H});
  };
  at::Tensor packed = at::stack({half(0), half(I)}, 2).reshape({E, 2 * padded, H}).contiguous();
  return {packed, at::constant_pad_nd(down, {0, padded - I}).contiguous()};
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                       const at::Tensor& ids, const at::Tensor& weights) {
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && weights.sizes() == ids.sizes() &&
                  ids.size(0) == x.size(0), "moe_experts: x [T, H], ids and weights [T, k]");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "moe_experts: ids must be int64");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "moe_experts: x must be float32 or bfloat16");
  const int64_t T = x.size(0), H = x.size(1), E = gate_up.size(0), I = down.size(2);
  // The packed widths (pack_moe_experts): the dpbf16 layout pads H to even (gate_up) and to
  // whole blocks of 16 (down's outputs), I to whole blocks of 16.
  const bool dp = kDpBf16 && gate_up.scalar_type() == at::kBFloat16;
  const int64_t K = dp ? (H + 1) / 2 * 2 : H, Hy = dp ? (H + 15) / 16 * 16 : H;
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(1) == 2 * I &&
                  gate_up.size(2) == K && down.size(0) == E && down.size(1) == Hy &&
                  I % (dp ? 16 : kBlock) == 0 && gate_up.is_contiguous() && down.is_contiguous(),
              "moe_experts: weights not packed by pack_moe_experts for x of width ", H);
  at::Tensor out = at::empty({T, H}, x.options());
  if (T == 0) return out;
  const int64_t k = ids.size(1);
  const at::Tensor id = ids.contiguous();
  const at::Tensor wt = weights.to(at::kFloat).contiguous();
  const Routing r = sort_by_expert(id, E);
  at::Tensor y = at::empty({T * k, Hy}, x.options().dtype(at::kFloat));
  auto go = [&](auto weight) {
    using W = decltype(weight);
    using X = RowT<W>;
    const at::ScalarType rows = std::is_same_v<X, float> ? at::kFloat : at::kBFloat16;
    const at::Tensor xs = x.to(rows).contiguous();
    at::Tensor act = at::empty({T * k, I}, xs.options());
    run<W>(xs.data_ptr<X>(), H, gate_up.data_ptr<W>(), down.data_ptr<W>(), I, r,
           act.data_ptr<X>(), y.data_ptr<float>());
  };
  if (dp) {
#ifdef CARPOOL_AVX512_BF16
    at::Tensor xs = x.to(at::kBFloat16).contiguous();
    if (K != H) xs = at::constant_pad_nd(xs, {0, K - H});
    at::Tensor act = at::empty({T * k, I}, xs.options());
    run_dpbf16(xs.data_ptr<at::BFloat16>(), K, gate_up.data_ptr<at::BFloat16>(),
               down.data_ptr<at::BFloat16>(), I, Hy, r, act.data_ptr<at::BFloat16>(),
               y.data_ptr<float>());
#endif
  } else if (gate_up.scalar_type() == at::kBFloat16) {
    go(at::BFloat16());
  } else {
    go(float());
  }
  weighted_sum(y.data_ptr<float>(), Hy, wt.data_ptr<float>(), id.data_ptr<int64_t>(), k, r, out);
  return out;
}

}  // namespace carpool_moe
