// LoRA adapters' term for one linear of one step: out[rows of g] += (x·A_g)·B_g per adapter
// g, in place (lora/step_lora.py; its reference is lora_add_reference).
//
// Why its own loop: a step mixing N adapters adds two or more small matmuls per adapter to
// each of a layer's four linears, and through torch each is an op call of a few rows;
// here one call does every adapter's rows of one linear. The rows of one adapter are one
// slice of the step (the runner sorts a step by adapter), so the work goes by adapter: a
// thread takes a block of one adapter's rows and runs punica's two passes over it,
//   shrink: T[rows, rank] = x[rows]·A_g, in tiles of a few rows times a few 16-wide (AVX2:
//           8-wide) blocks of ranks, float32 sums in registers: a pass over A_g serves the
//           tile's rows, instead of each row streaming A_g again;
//   expand: out[rows, cols] += T[rows, r0:r1]·B_p per part p, in tiles of rows times a few
//           blocks of columns: a tile's slice of B_p is read once for its rows, its sums kept
//           in float32 and added to out once (one rounding).
// bfloat16 A, B and x are widened to float32 as they are loaded (x once per block); the
// products are float32 FMAs on both builds (AVX-512's 16 lanes or AVX2's 8), so they keep T
// in float32 as the reference does.
//
// A row's result does not depend on which rows share its step: its sums run over k (then j)
// in the same order in every tile shape, and the tiles only decide which rows share a load.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "gemm/tile_dispatch.h"

namespace carpool_gemm {

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

#if defined(CPU_CAPABILITY_AVX512)
// 32 vector registers: a tile's sums, its loads of A or B and a broadcast
constexpr int kShrinkRows = 8, kShrinkBlocks = 3;  // 24 sums
constexpr int kExpandRows = 6, kExpandBlocks = 4;  // 24 sums
constexpr int64_t kItemRows = 16;  // a thread's block of one adapter's rows
#else
// 16 vector registers (AVX2; the DEFAULT build's generic vectors take the same shapes)
constexpr int kShrinkRows = 4, kShrinkBlocks = 2;  // 8 sums
constexpr int kExpandRows = 4, kExpandBlocks = 2;  // 8 sums
constexpr int64_t kItemRows = 16;  // a thread's block of one adapter's rows
#endif

// The tiles' loops work on the raw registers where the build has them: through Vectorized's
// wrappers GCC kept each step's broadcast (and, with a branch in the loop, every sum) in
// memory, a store per register a step.
#if defined(CPU_CAPABILITY_AVX512)
using Reg = __m512;
inline Reg splat(float v) { return _mm512_set1_ps(v); }
inline Reg mul_add(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
inline Reg load_whole(const float* p) { return _mm512_loadu_ps(p); }
inline Reg load_whole(const c10::BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
#elif defined(CPU_CAPABILITY_AVX2)
using Reg = __m256;
inline Reg splat(float v) { return _mm256_set1_ps(v); }
inline Reg mul_add(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
inline Reg load_whole(const float* p) { return _mm256_loadu_ps(p); }
inline Reg load_whole(const c10::BFloat16* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
#else
using Reg = Vec;
inline Reg splat(float v) { return Vec(v); }
inline Reg mul_add(const Reg& a, const Reg& b, const Reg& c) { return at::vec::fmadd(a, b, c); }
inline Reg load_whole(const float* p) { return Vec::loadu(p); }
inline Reg load_whole(const c10::BFloat16* p) {
  Vec v;
  at::vec::load_to_float<c10::BFloat16>(p, v);
  return v;
}
#endif

// The first n values from p widened to float32 (lanes [n, kLanes) zero); kWhole: n == kLanes.
// The tiles' loops take the whole form: a branch on n inside them made GCC keep their sums
// in memory.
template <bool kWhole, typename scalar_t>
inline Reg load_f32(const scalar_t* p, int64_t n) {
  if constexpr (kWhole) {
    return load_whole(p);
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    return n >= kLanes ? load_whole(p) : Reg(Vec::loadu(p, n));
  } else {
    if (n >= kLanes) return load_whole(p);
    return Reg(std::get<0>(at::vec::convert_to_float<c10::BFloat16>(
        at::vec::Vectorized<c10::BFloat16>::loadu(p, n))));
  }
}

// out[0, n) = out + sums, rounded once to out's dtype (n <= kLanes; kWhole: n == kLanes).
template <bool kWhole>
inline void add_into(float* out, Reg sums, int64_t n) {
  const Vec total = Vec(load_f32<kWhole>(out, n)) + Vec(sums);
  if constexpr (kWhole) {
    total.store(out);
  } else {
    total.store(out, std::min(n, kLanes));
  }
}

template <bool kWhole>
inline void add_into(c10::BFloat16* out, Reg sums, int64_t n) {
  const Vec total = Vec(load_f32<kWhole>(out, n)) + Vec(sums);
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  // one instruction, rounding to nearest even as c10 does
  const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(total);
  if constexpr (kWhole) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), rounded);
  } else {
    _mm256_mask_storeu_epi16(out, static_cast<__mmask16>((1u << std::min(n, kLanes)) - 1),
                             rounded);
  }
#else
  at::vec::convert_from_float<c10::BFloat16>(total, total).store(out, std::min(n, kLanes));
#endif
}

// t[r][rank0, rank0 + NB * kLanes) (+)= x[r][k0, k1)·A[k0:k1, rank0 : rank0 + NB * kLanes) for
// the R rows of x (float32, x_stride apart), onto t's values where `accumulate`, else from 0.
// A is [in_features, rank] at `a`; the last block holds `last` ranks (1..kLanes), read as
// such unless kWhole (rows k whose whole block lies within A: the lanes past its ranks are
// the next row's values, summed into t's padding, which nothing reads).
template <typename scalar_t, int R, int NB, bool kWhole>
__attribute__((noinline)) void shrink_tile(const float* x, int64_t x_stride, const scalar_t* a,
                                           int64_t k0, int64_t k1, int64_t rank, int64_t rank0,
                                           int64_t last, bool accumulate, float* t,
                                           int64_t t_stride) {
  Reg acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b)
      acc[r][b] = accumulate ? load_whole(t + r * t_stride + rank0 + b * kLanes) : splat(0.0f);
  for (int64_t k = k0; k < k1; ++k) {
    const scalar_t* ak = a + k * rank + rank0;
    Reg w[NB];
    for (int b = 0; b < NB - 1; ++b) w[b] = load_whole(ak + b * kLanes);
    w[NB - 1] = load_f32<kWhole>(ak + (NB - 1) * kLanes, last);
    for (int r = 0; r < R; ++r) {
      const Reg xv = splat(x[r * x_stride + k]);
      for (int b = 0; b < NB; ++b) acc[r][b] = mul_add(xv, w[b], acc[r][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) Vec(acc[r][b]).store(t + r * t_stride + rank0 + b * kLanes);
}

// out[r][0, n) += t[r][0, rank)·B[:, 0, n) for R rows, n <= NB * kLanes (kWhole: n equal to
// it): B [rank, columns] at `b` (row stride b_stride), t float32 (t_stride apart), out rows
// out_stride apart.
template <typename scalar_t, int R, int NB, bool kWhole>
__attribute__((noinline)) void expand_tile(const float* t, int64_t t_stride, const scalar_t* b,
                                           int64_t b_stride, int64_t rank, int64_t n,
                                           scalar_t* out, int64_t out_stride) {
  Reg acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NB; ++c) acc[r][c] = splat(0.0f);
  for (int64_t j = 0; j < rank; ++j) {
    const scalar_t* bj = b + j * b_stride;
    Reg w[NB];
    for (int c = 0; c < NB; ++c) w[c] = load_f32<kWhole>(bj + c * kLanes, n - c * kLanes);
    for (int r = 0; r < R; ++r) {
      const Reg tv = splat(t[r * t_stride + j]);
      for (int c = 0; c < NB; ++c) acc[r][c] = mul_add(tv, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NB; ++c)
      add_into<kWhole>(out + r * out_stride + c * kLanes, acc[r][c], n - c * kLanes);
}

// [begin, end) cut into ceil(len / max_rows) tiles of nearly equal heights, as (first, rows).
void row_tiles(int64_t begin, int64_t end, int64_t max_rows,
               std::vector<std::pair<int64_t, int64_t>>& tiles) {
  const int64_t len = end - begin;
  if (len <= 0) return;
  const int64_t count = (len + max_rows - 1) / max_rows;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t first = begin + len * i / count, next = begin + len * (i + 1) / count;
    tiles.emplace_back(first, next - first);
  }
}

inline int64_t padded(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// A thread's float32 scratch, reused call to call (one for x widened, one for T).
float* scratch(std::vector<float>& held, int64_t values) {
  if (static_cast<int64_t>(held.size()) < values) held.resize(values);
  return held.data();
}

template <typename scalar_t>
void lora_groups(at::Tensor& out, const at::Tensor& x, const std::vector<int64_t>& starts,
                 const std::vector<int64_t>& ends, const std::vector<at::Tensor>& a,
                 const std::vector<at::Tensor>& b, const std::vector<int64_t>& parts) {
  const int64_t in_features = x.size(1), out_features = out.size(1);
  const int64_t groups = static_cast<int64_t>(a.size());
  const scalar_t* xs = x.data_ptr<scalar_t>();
  scalar_t* os = out.data_ptr<scalar_t>();
  std::vector<std::vector<int64_t>> group_parts(groups);
  for (int64_t p = 0; p < static_cast<int64_t>(b.size()); ++p)
    group_parts[parts[4 * p]].push_back(p);
  // items: blocks of one adapter's rows, each shrunk then expanded by one thread, so a call
  // is one fork and join (as the base linear's), not one a pass
  std::vector<std::pair<int64_t, int64_t>> blocks;
  std::vector<int64_t> block_group;
  for (int64_t g = 0; g < groups; ++g) {
    row_tiles(starts[g], ends[g], kItemRows, blocks);
    block_group.resize(blocks.size(), g);
  }
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t lo, int64_t hi) {
    thread_local std::vector<float> x_held, t_held;
    std::vector<std::pair<int64_t, int64_t>> tiles;
    for (int64_t item = lo; item < hi; ++item) {
      const auto [first, count] = blocks[item];
      const int64_t g = block_group[item];
      const int64_t rank = a[g].size(1), t_stride = padded(rank);
      const scalar_t* ag = a[g].data_ptr<scalar_t>();
      const float* xf;
      if constexpr (std::is_same_v<scalar_t, float>) {
        xf = xs + first * in_features;
      } else {
        float* widened = scratch(x_held, count * in_features);
        at::vec::convert(xs + first * in_features, widened, count * in_features);
        xf = widened;
      }
      float* t = scratch(t_held, count * t_stride);
      // shrink: T = x·A, tiles of rows times every rank block of A
      tiles.clear();
      row_tiles(0, count, kShrinkRows, tiles);
      for (int64_t rank0 = 0; rank0 < rank; rank0 += kShrinkBlocks * kLanes) {
        const int64_t left = rank - rank0;
        const int64_t nb = std::min<int64_t>(kShrinkBlocks, (left + kLanes - 1) / kLanes);
        const int64_t last = std::min(kLanes, left - (nb - 1) * kLanes);
        // rows k < whole read the last block whole: it ends within A
        const int64_t span = rank0 + nb * kLanes;  // row k reads A up to k * rank + span
        const int64_t whole = last == kLanes ? in_features
            : in_features * rank < span ? 0 : (in_features * rank - span) / rank + 1;
        for (const auto& [row0, rows] : tiles) {
          const float* xr = xf + row0 * in_features;
          float* tr = t + row0 * t_stride;
          dispatch_tile<kShrinkRows, kShrinkBlocks>(rows, nb, [&]<int R, int NB>() {
            shrink_tile<scalar_t, R, NB, true>(xr, in_features, ag, 0, whole, rank, rank0,
                                               last, false, tr, t_stride);
            if (whole < in_features)
              shrink_tile<scalar_t, R, NB, false>(xr, in_features, ag, whole, in_features,
                                                  rank, rank0, last, true, tr, t_stride);
          });
        }
      }
      // expand: out += T[:, r0:r1]·B per part, tiles of rows times blocks of columns
      tiles.clear();
      row_tiles(0, count, kExpandRows, tiles);
      constexpr int64_t kColumns = kExpandBlocks * kLanes;
      for (const int64_t p : group_parts[g]) {
        const int64_t col0 = parts[4 * p + 1], r0 = parts[4 * p + 2], r1 = parts[4 * p + 3];
        const int64_t cols = b[p].size(1);
        for (int64_t col = 0; col < cols; col += kColumns) {
          const int64_t n = std::min(kColumns, cols - col);
          const scalar_t* bp = b[p].data_ptr<scalar_t>() + col;
          for (const auto& [row0, rows] : tiles) {
            const float* tr = t + row0 * t_stride + r0;
            scalar_t* orow = os + (first + row0) * out_features + col0 + col;
            dispatch_tile<kExpandRows, kExpandBlocks>(rows, (n + kLanes - 1) / kLanes,
                                                      [&]<int R, int NB>() {
              if (n == NB * kLanes) {
                expand_tile<scalar_t, R, NB, true>(tr, t_stride, bp, cols, r1 - r0, n, orow,
                                                   out_features);
              } else {
                expand_tile<scalar_t, R, NB, false>(tr, t_stride, bp, cols, r1 - r0, n, orow,
                                                    out_features);
              }
            });
          }
        }
      }
    }
  });
}

}  // namespace

void lora_add_(at::Tensor& out, const at::Tensor& x, const std::vector<int64_t>& starts,
               const std::vector<int64_t>& ends, const std::vector<at::Tensor>& a,
               const std::vector<at::Tensor>& b, const std::vector<int64_t>& parts) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && out.size(0) == x.size(0),
              "lora_add_: out [T, O] and x [T, I] must have the same rows");
  TORCH_CHECK(out.is_contiguous() && x.is_contiguous(), "lora_add_: out and x must be contiguous");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "lora_add_: out and x differ in dtype");
  TORCH_CHECK(starts.size() == ends.size() && starts.size() == a.size(),
              "lora_add_: one start, end and A per adapter");
  TORCH_CHECK(parts.size() == 4 * b.size(), "lora_add_: parts holds (group, col0, r0, r1) per B");
  for (size_t g = 0; g < a.size(); ++g) {
    TORCH_CHECK(0 <= starts[g] && starts[g] <= ends[g] && ends[g] <= out.size(0),
                "lora_add_: rows out of range");
    TORCH_CHECK(a[g].dim() == 2 && a[g].size(0) == x.size(1) && a[g].size(1) > 0 &&
                    a[g].is_contiguous() && a[g].scalar_type() == x.scalar_type(),
                "lora_add_: each A must be contiguous [in_features, rank] of x's dtype");
  }
  for (size_t p = 0; p < b.size(); ++p) {
    const int64_t g = parts[4 * p], col0 = parts[4 * p + 1], r0 = parts[4 * p + 2],
                  r1 = parts[4 * p + 3];
    TORCH_CHECK(0 <= g && g < static_cast<int64_t>(a.size()), "lora_add_: no adapter ", g);
    TORCH_CHECK(b[p].dim() == 2 && b[p].is_contiguous() && b[p].scalar_type() == x.scalar_type()
                    && b[p].size(0) == r1 - r0 && 0 <= r0 && r1 <= a[g].size(1) && 0 <= col0 &&
                    col0 + b[p].size(1) <= out.size(1),
                "lora_add_: each B must be contiguous [r1 - r0, columns] within out and A");
  }
  if (x.scalar_type() == at::kFloat) {
    lora_groups<float>(out, x, starts, ends, a, b, parts);
  } else if (x.scalar_type() == at::kBFloat16) {
    lora_groups<c10::BFloat16>(out, x, starts, ends, a, b, parts);
  } else {
    TORCH_CHECK(false, "lora_add_: float32 or bfloat16, got ", x.scalar_type());
  }
}

}  // namespace carpool_gemm
