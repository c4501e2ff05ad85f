// Vectorised inner loops over one cache block of paged attention, and their dispatch tables.
//
// Everything works on float32 rows padded with zeros to whole at::vec::Vectorized<float>
// vectors (NV of them per head_dim): scores of R query rows against a block's keys, either
// one key row at a time (a horizontal sum per row and key) or from the block transposed
// (broadcast-FMAs, no horizontal sums), and the probability-weighted sum of value rows with
// the R accumulators in registers. NV and R are template parameters so the compiler keeps
// rows in registers; `block_ops<kv_t>()` looks the instantiations up at run time.

#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>

namespace carpool_cpu {

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
constexpr int kMaxRows = 4;   // query rows per register pass

inline int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// One row of NV float vectors from float32 or (NV even) bfloat16/float16 values.
template <typename kv_t, int NV>
inline void load_row(const kv_t* row, Vec (&x)[NV]) {
  if constexpr (std::is_same_v<kv_t, float>) {
    for (int v = 0; v < NV; ++v) x[v] = Vec::loadu(row + v * Vec::size());
  } else {
    static_assert(NV % 2 == 0, "reduced-precision rows are read as whole pairs of vectors");
    for (int v = 0; v < NV; v += 2) {
      auto [lo, hi] = at::vec::convert_to_float<kv_t>(at::vec::Vectorized<kv_t>::loadu(row + v * Vec::size()));
      x[v] = lo;
      x[v + 1] = hi;
    }
  }
}

// scores[r * score_stride + t] = queries[r] . keys[t] for t in [t_begin, t_end), R rows at once:
// each key row is loaded (and converted) once into registers for the R queries.
template <typename kv_t, int NV, int R>
void block_scores(const float* queries, int64_t q_stride, const kv_t* keys, int64_t key_stride,
                  int64_t t_begin, int64_t t_end, float* scores, int64_t score_stride) {
  for (int64_t t = t_begin; t < t_end; ++t) {
    Vec k[NV];
    load_row(keys + t * key_stride, k);
    Vec acc[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = Vec::loadu(queries + r * q_stride) * k[0];
      for (int v = 1; v < NV; ++v) {
        acc[r] = at::vec::fmadd(Vec::loadu(queries + r * q_stride + v * Vec::size()), k[v], acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      scores[r * score_stride + t] = at::vec::vec_reduce_all<float>(std::plus<Vec>(), acc[r]);
    }
  }
}

// The same scores from the block's keys transposed (keys_t[d * score_stride + t], all
// score_stride columns): q[r][d] broadcast times a vector of keys, no horizontal sums.
// Used where ATen transposes with vector shuffles (AVX512); columns past the block's keys
// hold stale finite values, masked by the softmax.
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
void block_values(const float* probs, int64_t prob_stride, const kv_t* values,
                  int64_t value_stride, int64_t t_begin, int64_t t_end, const float* correction,
                  float* acc, int64_t acc_stride) {
  Vec a[R][NV];
  for (int r = 0; r < R; ++r) {
    const Vec c(correction[r]);
    for (int v = 0; v < NV; ++v) a[r][v] = Vec::loadu(acc + r * acc_stride + v * Vec::size()) * c;
  }
  for (int64_t t = t_begin; t < t_end; ++t) {
    Vec x[NV];
    load_row(values + t * value_stride, x);
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
using ScoresFn = void (*)(const float*, int64_t, const kv_t*, int64_t, int64_t, int64_t, float*,
                          int64_t);
template <typename kv_t>
using ValuesFn = void (*)(const float*, int64_t, const kv_t*, int64_t, int64_t, int64_t,
                          const float*, float*, int64_t);
using TransposedScoresFn = void (*)(const float*, int64_t, const float*, int64_t, float*,
                                    int64_t);
constexpr int kMaxKeyVecs = 4;         // block_size up to 4 vectors for the transposed scores
constexpr int kMaxTransposedRows = 8;  // query rows per pass there

// The (NV, R) instantiations reading kv_t rows, looked up at run time: table[NV - 1][R - 1]
// (for bfloat16/float16, even NV only; the transposed ones exist for float only).
template <typename kv_t>
struct BlockOps {
  ScoresFn<kv_t> scores[kMaxVecs][kMaxRows];
  ValuesFn<kv_t> values[kMaxVecs][kMaxRows];
  TransposedScoresFn transposed[kMaxKeyVecs][kMaxTransposedRows];
};

template <int KV, int... R>
void fill_transposed(BlockOps<float>& ops, std::integer_sequence<int, R...>) {
  ((ops.transposed[KV - 1][R] = &block_scores_transposed<KV, R + 1>), ...);
}

// Rows per register pass for a head_dim of num_vecs vectors: the accumulators fit in registers.
constexpr int64_t rows_per_pass(int64_t num_vecs) {
  return std::max<int64_t>(1, std::min<int64_t>(kMaxRows, 12 / num_vecs));
}

template <typename kv_t, int NV, int R>
void fill_row(BlockOps<kv_t>& ops) {
  // Only the passes attend_item makes; reduced-precision rows in whole pairs of vectors.
  if constexpr (R <= rows_per_pass(NV) && (std::is_same_v<kv_t, float> || NV % 2 == 0)) {
    ops.scores[NV - 1][R - 1] = &block_scores<kv_t, NV, R>;
    ops.values[NV - 1][R - 1] = &block_values<kv_t, NV, R>;
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
    fill_transposed<1>(ops, std::make_integer_sequence<int, kMaxTransposedRows>{});
    fill_transposed<2>(ops, std::make_integer_sequence<int, kMaxTransposedRows>{});
    fill_transposed<3>(ops, std::make_integer_sequence<int, kMaxTransposedRows>{});
    fill_transposed<4>(ops, std::make_integer_sequence<int, kMaxTransposedRows>{});
  }
  return ops;
}

template <typename kv_t>
const BlockOps<kv_t>& block_ops() {
  static const BlockOps<kv_t> ops = make_ops<kv_t>(std::make_integer_sequence<int, kMaxVecs>{});
  return ops;
}

}  // namespace carpool_cpu
