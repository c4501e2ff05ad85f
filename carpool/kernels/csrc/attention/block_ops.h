// Vectorised inner loops of paged attention over one chunk of keys, and their dispatch tables.
//
// Everything works on float32 rows padded with zeros to whole at::vec::Vectorized<float>
// vectors (NV of them per head_dim). Keys and values are reached through a table of row
// pointers (a chunk's rows sit in several cache blocks). Scores come two ways:
// - by row (chunk_scores_by_row): up to 3 query rows against W = Vec::size() keys at a time,
//   each key row loaded once; the W partial-sum vectors of a row are folded into one vector
//   of W scores by a transpose-add tree (AVX512 and AVX2; a horizontal sum per key
//   elsewhere). Every score's sum runs in one fixed order.
// - transposed (block_scores_transposed): R query rows against a transposed copy of the
//   keys, broadcast-FMAs over head_dim and no horizontal sums; for tiles of many rows.
// The probability-weighted sum of value rows keeps R rows' accumulators in registers.
// NV and R are template parameters so the compiler keeps rows in registers;
// `block_ops<kv_t>()` looks the instantiations up at run time.

#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>

namespace carpool_cpu {
// Internal linkage: the static dispatch tables would otherwise be process-wide unique symbols
// (STB_GNU_UNIQUE), so two builds of these sources loaded in one process (a benchmark that
// times two checkouts) would share one table.
namespace {

using Vec = at::vec::Vectorized<float>;

// n values -> float32 (dst), vectorised.
template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    using VecS = at::vec::Vectorized<scalar_t>;
    int64_t i = 0;
    for (; i + VecS::size() <= n; i += VecS::size()) {
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(VecS::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + Vec::size());
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// dst[d] = scalar_t(src[d] * factor) for d < n.
template <typename scalar_t>
inline void store_scaled(const float* src, float factor, scalar_t* dst, int64_t n) {
  const Vec f(factor);
  int64_t i = 0;
  if constexpr (std::is_same_v<scalar_t, float>) {
    for (; i + Vec::size() <= n; i += Vec::size()) (Vec::loadu(src + i) * f).store(dst + i);
  } else {
    using VecS = at::vec::Vectorized<scalar_t>;
    for (; i + VecS::size() <= n; i += VecS::size()) {
      Vec lo = Vec::loadu(src + i) * f;
      Vec hi = Vec::loadu(src + i + Vec::size()) * f;
      at::vec::convert_from_float<scalar_t>(lo, hi).store(dst + i);
    }
  }
  for (; i < n; ++i) dst[i] = static_cast<scalar_t>(src[i] * factor);
}

// Float rows of queries, keys, values and accumulators are padded with zeros to whole vectors
// (at most kMaxVecs per row), so the inner loops below use whole vectors only; cache rows
// read in place (load_row on bfloat16/float16) fill whole vectors by construction.
constexpr int kMaxVecs = 16;  // head_dim up to 16 vectors: 256 with AVX512, 128 with AVX2
constexpr int kMaxRows = 6;   // query rows per register pass of the value sums
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kVecRegisters = 32;
#else
constexpr int kVecRegisters = 16;
#endif

inline int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// One row of NV float vectors from float32 or bfloat16/float16 values (those by pairs of
// vectors, an odd last vector on its own: exact conversions either way).
template <typename kv_t, int NV>
inline void load_row(const kv_t* row, Vec (&x)[NV]) {
  if constexpr (std::is_same_v<kv_t, float>) {
    for (int v = 0; v < NV; ++v) x[v] = Vec::loadu(row + v * Vec::size());
  } else {
    for (int v = 0; v + 1 < NV; v += 2) {
      auto [lo, hi] = at::vec::convert_to_float<kv_t>(at::vec::Vectorized<kv_t>::loadu(row + v * Vec::size()));
      x[v] = lo;
      x[v + 1] = hi;
    }
    if constexpr (NV % 2 == 1) at::vec::load_to_float<kv_t>(row + (NV - 1) * Vec::size(), x[NV - 1]);
  }
}

// The dot product of a query row (NV float vectors at q) with a key row: lane-wise partial
// sums, head_dim vectors added in order.
template <int NV>
inline Vec partial_dot(const float* q, const Vec (&k)[NV]) {
  Vec a = Vec::loadu(q) * k[0];
  for (int v = 1; v < NV; ++v) a = at::vec::fmadd(Vec::loadu(q + v * Vec::size()), k[v], a);
  return a;
}

// Vector v of a row (W values from v * W) as float32: load_row's values, one vector at a time.
template <typename kv_t>
__attribute__((always_inline)) inline Vec load_vec(const kv_t* row, int v) {
  if constexpr (std::is_same_v<kv_t, float>) {
    return Vec::loadu(row + v * Vec::size());
  } else {
    Vec x;
    at::vec::load_to_float<kv_t>(row + v * Vec::size(), x);
    return x;
  }
}

#if defined(CPU_CAPABILITY_AVX2)
// The transpose-add tree that turns 8 keys' partial-sum vectors into one vector of 8 scores
// (lane t: the sum of key t's lanes), one level at a time, each level adding two neighbours
// of the level below, in key order (the AVX2 form of chunk_scores_by_row's AVX512 tree; also
// decode_one_pass_avx2.h's).
__attribute__((always_inline)) inline __m256 fold_keys8(__m256 a, __m256 b) {
  // per 128 bits: [a l0+l2, b l0+l2, a l1+l3, b l1+l3]
  return _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
}
__attribute__((always_inline)) inline __m256 fold_pairs8(__m256 a, __m256 b) {
  // per 128 bits: keys 0 .. 3, each the sum of its lanes in that half
  const __m256d x = _mm256_castps_pd(a), y = _mm256_castps_pd(b);
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                       _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
}
__attribute__((always_inline)) inline __m256 fold_halves8(__m256 a, __m256 b) {
  // keys 0 .. 3 of a, then of b: the low halves plus the high halves
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

// scores[r * score_stride + t] = queries[r] . keys[t] for R rows and t in
// [j_begin * W, j_end * W), W = Vec::size(): every key row of those groups must be readable
// (rows outside a caller's range may point at zeros). Each key row is loaded (and converted)
// once for the R rows. Every score is its own dot product, summed in one fixed order (lanes,
// then a tree over the lanes) whatever R and the other keys.
template <typename kv_t, int NV, int R>
void chunk_scores_by_row(const float* queries, int64_t q_stride, const kv_t* const* keys,
                         int64_t j_begin, int64_t j_end, float* scores, int64_t score_stride) {
  constexpr int W = Vec::size();
  for (int64_t j = j_begin; j < j_end; ++j) {
    const kv_t* const* group = keys + j * W;
#if defined(CPU_CAPABILITY_AVX512)
    // A transpose-add tree folds 16 keys' partial-sum vectors into one vector of 16 scores,
    // level by level as the keys come, so that R rows' partial sums fit in registers:
    // pairs of keys interleaved and added (per 128 bits: [k0 l0+l2, k1 l0+l2, k0 l1+l3,
    // k1 l1+l3]), then pairs of pairs (per 128 bits: keys 4i .. 4i+3, each its lanes' sum),
    // then 128-bit and 256-bit halves.
    __m512 quad[R][4];
    for (int i = 0; i < 4; ++i) {
      __m512 pair[R][2];
      for (int p = 0; p < 2; ++p) {
        Vec k0[NV], k1[NV];
        load_row(group[4 * i + 2 * p], k0);
        load_row(group[4 * i + 2 * p + 1], k1);
        for (int r = 0; r < R; ++r) {
          const __m512 a0 = partial_dot<NV>(queries + r * q_stride, k0);
          const __m512 a1 = partial_dot<NV>(queries + r * q_stride, k1);
          pair[r][p] = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512d x = _mm512_castps_pd(pair[r][0]), y = _mm512_castps_pd(pair[r][1]);
        quad[r][i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512 half[2];
      for (int i = 0; i < 2; ++i) {  // [keys 8i.. (q0+q2), (q1+q3), keys 8i+4.. the same]
        half[i] = _mm512_add_ps(
            _mm512_shuffle_f32x4(quad[r][2 * i], quad[r][2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
            _mm512_shuffle_f32x4(quad[r][2 * i], quad[r][2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
      }
      _mm512_storeu_ps(scores + r * score_stride + j * W,
                       _mm512_add_ps(_mm512_shuffle_f32x4(half[0], half[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(half[0], half[1], _MM_SHUFFLE(3, 1, 3, 1))));
    }
#elif defined(CPU_CAPABILITY_AVX2)
    // The same tree for 8 keys (fold_keys8, fold_pairs8, fold_halves8). A key pair's rows
    // are read a vector at a time (a whole row of head_dim 64 would take 8 of the 16
    // registers), each vector for the R rows, the partial sums in partial_dot's order.
    __m256 quad[R][2];
    for (int i = 0; i < 2; ++i) {
      __m256 pair[R][2];
      for (int p = 0; p < 2; ++p) {
        const kv_t* k0 = group[4 * i + 2 * p];
        const kv_t* k1 = group[4 * i + 2 * p + 1];
        Vec a0[R], a1[R];
        for (int v = 0; v < NV; ++v) {
          const Vec x0 = load_vec(k0, v), x1 = load_vec(k1, v);
          for (int r = 0; r < R; ++r) {
            const Vec qv = Vec::loadu(queries + r * q_stride + v * W);
            a0[r] = v == 0 ? qv * x0 : at::vec::fmadd(qv, x0, a0[r]);
            a1[r] = v == 0 ? qv * x1 : at::vec::fmadd(qv, x1, a1[r]);
          }
        }
        for (int r = 0; r < R; ++r) pair[r][p] = fold_keys8(a0[r], a1[r]);
      }
      for (int r = 0; r < R; ++r) quad[r][i] = fold_pairs8(pair[r][0], pair[r][1]);
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(scores + r * score_stride + j * W, fold_halves8(quad[r][0], quad[r][1]));
    }
#else
    for (int k = 0; k < W; ++k) {
      Vec key[NV];
      load_row(group[k], key);
      for (int r = 0; r < R; ++r) {
        scores[r * score_stride + j * W + k] = at::vec::vec_reduce_all<float>(
            std::plus<Vec>(), partial_dot<NV>(queries + r * q_stride, key));
      }
    }
#endif
  }
}

#if defined(CPU_CAPABILITY_AVX2)
// dst[d * dst_stride + k] = src[k * src_stride + d] for an 8 x 8 tile: 8 row loads, three
// levels of shuffles, 8 column stores.
__attribute__((always_inline)) inline void transpose_8x8(const float* src, int64_t src_stride,
                                                         float* dst, int64_t dst_stride) {
  __m256 r[8], t[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(src + k * src_stride);
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
    t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {
    r[k] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_ps(dst + k * dst_stride, _mm256_permute2f128_ps(r[k], r[k + 4], 0x20));
    _mm256_storeu_ps(dst + (k + 4) * dst_stride, _mm256_permute2f128_ps(r[k], r[k + 4], 0x31));
  }
}
#endif

// dst[d * dst_stride + k] = src[k * src_stride + d] for k < n keys and d < head_dim: a run of
// key rows turned into the columns block_scores_transposed reads. ATen's transpose_mxn does
// it with vector shuffles on AVX512 only; AVX2 takes 8 x 8 tiles (and scalar edges).
inline void transpose_keys(const float* src, int64_t src_stride, float* dst, int64_t dst_stride,
                           int64_t n, int64_t head_dim) {
#if defined(CPU_CAPABILITY_AVX2)
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    int64_t d = 0;
    for (; d + 8 <= head_dim; d += 8) {
      transpose_8x8(src + k * src_stride + d, src_stride, dst + d * dst_stride + k, dst_stride);
    }
    for (; d < head_dim; ++d) {
      for (int i = 0; i < 8; ++i) dst[d * dst_stride + k + i] = src[(k + i) * src_stride + d];
    }
  }
  for (; k < n; ++k) {
    for (int64_t d = 0; d < head_dim; ++d) dst[d * dst_stride + k] = src[k * src_stride + d];
  }
#else
  at::vec::transpose_mxn<float>(src, src_stride, dst, dst_stride, static_cast<int>(n),
                                static_cast<int>(head_dim));
#endif
}

// The scores of R query rows against KV vectors of keys from the keys transposed
// (keys_t[d * score_stride + k], the columns of those vectors): q[r][d] broadcast times a
// vector of keys, no horizontal sums. Used where the keys transpose with vector shuffles
// (transpose_keys: AVX512 and AVX2).
template <int KV, int R>
void block_scores_transposed(const float* queries, int64_t q_stride, const float* keys_t,
                             int64_t head_dim, float* scores, int64_t score_stride) {
  Vec acc[R][KV];
  for (int r = 0; r < R; ++r) {
    for (int k = 0; k < KV; ++k) acc[r][k] = Vec(0.f);
  }
  for (int64_t d = 0; d < head_dim; ++d) {
    Vec kt[KV];
    for (int k = 0; k < KV; ++k) kt[k] = Vec::loadu(keys_t + d * score_stride + k * Vec::size());
    for (int r = 0; r < R; ++r) {
      const Vec qd(queries[r * q_stride + d]);
      for (int k = 0; k < KV; ++k) acc[r][k] = at::vec::fmadd(qd, kt[k], acc[r][k]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int k = 0; k < KV; ++k) acc[r][k].store(scores + r * score_stride + k * Vec::size());
  }
}

// acc[r] = acc[r] * correction[r] + sum_t probs[r][t] * values[t], t in [t_begin, t_end),
// R rows at once with the accumulators in registers.
template <typename kv_t, int NV, int R>
void chunk_values(const float* probs, int64_t prob_stride, const kv_t* const* values,
                  int64_t t_begin, int64_t t_end, const float* correction, float* acc,
                  int64_t acc_stride) {
  Vec a[R][NV];
  for (int r = 0; r < R; ++r) {
    const Vec c(correction[r]);
    for (int v = 0; v < NV; ++v) a[r][v] = Vec::loadu(acc + r * acc_stride + v * Vec::size()) * c;
  }
  for (int64_t t = t_begin; t < t_end; ++t) {
    Vec x[NV];
    load_row(values[t], x);
    for (int r = 0; r < R; ++r) {
      const Vec p(probs[r * prob_stride + t]);
      for (int v = 0; v < NV; ++v) a[r][v] = at::vec::fmadd(p, x[v], a[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) a[r][v].store(acc + r * acc_stride + v * Vec::size());
  }
}

template <typename kv_t>
using RowScoresFn = void (*)(const float*, int64_t, const kv_t* const*, int64_t, int64_t, float*,
                             int64_t);
template <typename kv_t>
using ValuesFn = void (*)(const float*, int64_t, const kv_t* const*, int64_t, int64_t,
                          const float*, float*, int64_t);
using TransposedScoresFn = void (*)(const float*, int64_t, const float*, int64_t, float*,
                                    int64_t);
// Key vectors per call of the transposed scores: R * KV accumulators, KV key vectors and a
// broadcast query value in the vector registers.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kMaxKeyVecs = 4;
#else
constexpr int kMaxKeyVecs = 2;
#endif
constexpr int kMaxTransposedRows = 6;  // query rows per pass there (R * KV accumulators)
constexpr int kMaxRowScoreRows = 3;    // query rows per pass of the scores by row

// The instantiations reading kv_t rows, looked up at run time: values[NV - 1][R - 1] and
// by_row[NV - 1][R - 1], transposed[KV - 1][R - 1] (float).
template <typename kv_t>
struct BlockOps {
  ValuesFn<kv_t> values[kMaxVecs][kMaxRows];
  RowScoresFn<kv_t> by_row[kMaxVecs][kMaxRowScoreRows];
  TransposedScoresFn transposed[kMaxKeyVecs][kMaxTransposedRows];
};

template <int KV, int... R>
void fill_transposed(BlockOps<float>& ops, std::integer_sequence<int, R...>) {
  ((ops.transposed[KV - 1][R] = &block_scores_transposed<KV, R + 1>), ...);
}

template <int... KV>
void fill_all_transposed(BlockOps<float>& ops, std::integer_sequence<int, KV...>) {
  (fill_transposed<KV + 1>(ops, std::make_integer_sequence<int, kMaxTransposedRows>{}), ...);
}

// Rows per register pass of the value sums for a head_dim of num_vecs vectors: the R * NV
// accumulators and one value row fit in the vector registers.
constexpr int64_t rows_per_pass(int64_t num_vecs) {
  return std::max<int64_t>(1, std::min<int64_t>(kMaxRows, (kVecRegisters - num_vecs) / num_vecs));
}

template <typename kv_t, int NV, int R>
void fill_row(BlockOps<kv_t>& ops) {
  // Only the passes attend_item makes.
  if constexpr (R <= rows_per_pass(NV)) {
    ops.values[NV - 1][R - 1] = &chunk_values<kv_t, NV, R>;
  }
  if constexpr (R <= kMaxRowScoreRows) {
    ops.by_row[NV - 1][R - 1] = &chunk_scores_by_row<kv_t, NV, R>;
  }
}

template <typename kv_t, int NV, int... R>
void fill_rows(BlockOps<kv_t>& ops, std::integer_sequence<int, R...>) {
  (fill_row<kv_t, NV, R + 1>(ops), ...);
}

template <typename kv_t, int... NV>
BlockOps<kv_t> make_ops(std::integer_sequence<int, NV...>) {
  BlockOps<kv_t> ops{};
  (fill_rows<kv_t, NV + 1>(ops, std::make_integer_sequence<int, kMaxRows>{}), ...);
  if constexpr (std::is_same_v<kv_t, float>) {
    fill_all_transposed(ops, std::make_integer_sequence<int, kMaxKeyVecs>{});
  }
  return ops;
}

template <typename kv_t>
const BlockOps<kv_t>& block_ops() {
  static const BlockOps<kv_t> ops = make_ops<kv_t>(std::make_integer_sequence<int, kMaxVecs>{});
  return ops;
}

}  // namespace
}  // namespace carpool_cpu
