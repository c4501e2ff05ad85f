// bfloat16 prompt tiles on CPUs with AVX512-BF16 (carpool/kernels/loader.py adds -mavx512bf16
// -DCARPOOL_AVX512_BF16 where /proc/cpuinfo lists avx512_bf16): vdpbf16ps multiplies pairs
// of bfloat16 values exactly and adds both products to a float32 lane, twice the rate of
// block_ops.h's float32 FMAs. Scores from keys transposed as pairs of d, value sums over
// values interleaved in pairs of keys (the probabilities rounded to bfloat16), and their
// dispatch table `pair_ops()`.

#pragma once

#include "attention/block_ops.h"

#if defined(CARPOOL_AVX512_BF16)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace carpool_cpu {
namespace {  // internal linkage, as in block_ops.h

// scores[r][k] = scale * sum_d q[r][d] * key_k[d] for KV vectors of keys: queries are
// bfloat16 rows (unscaled) read as 32-bit pairs of d, keys_p[i * score_stride + k] the
// pair (key k's d = 2i, 2i + 1), num_pairs = head_dim / 2.
template <int KV, int R>
void pair_scores_transposed(const uint32_t* queries, int64_t q_stride, const uint32_t* keys_p,
                            int64_t num_pairs, float scale, float* scores,
                            int64_t score_stride) {
  __m512 acc[R][KV];
  for (int r = 0; r < R; ++r) {
    for (int k = 0; k < KV; ++k) acc[r][k] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < num_pairs; ++i) {
    __m512bh kt[KV];
    for (int k = 0; k < KV; ++k) {
      kt[k] = (__m512bh)_mm512_loadu_si512(keys_p + i * score_stride + k * 16);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh q = (__m512bh)_mm512_set1_epi32(static_cast<int>(queries[r * q_stride + i]));
      for (int k = 0; k < KV; ++k) acc[r][k] = _mm512_dpbf16_ps(acc[r][k], q, kt[k]);
    }
  }
  const __m512 f = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    for (int k = 0; k < KV; ++k) {
      _mm512_storeu_ps(scores + r * score_stride + k * 16, _mm512_mul_ps(acc[r][k], f));
    }
  }
}

// Two bfloat16 value rows (NV vectors of 16 floats each: 2 * NV * 16 values in all)
// interleaved into NV vectors of 16 (row a, row b) pairs of d: out[v] holds d in
// [16v, 16v + 16).
// Two bfloat16 value rows of num_vecs * 16 values (num_vecs even) interleaved into num_vecs
// vectors of 16 (row a, row b) pairs of d: out vector v holds d in [16v, 16v + 16).
inline void interleave_rows(const at::BFloat16* a, const at::BFloat16* b, uint16_t* out,
                            int64_t num_vecs) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                      40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                      32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t v = 0; v < num_vecs; v += 2) {
    const __m512i x = _mm512_loadu_si512(a + v * 16), y = _mm512_loadu_si512(b + v * 16);
    _mm512_storeu_si512(out + v * 32, _mm512_permutex2var_epi16(x, lo, y));
    _mm512_storeu_si512(out + (v + 1) * 32, _mm512_permutex2var_epi16(x, hi, y));
  }
}

inline uint32_t bf16_pair(float a, float b) {
  return static_cast<uint32_t>(c10::BFloat16(a).x) |
         (static_cast<uint32_t>(c10::BFloat16(b).x) << 16);
}

// acc[r] = acc[r] * correction[r] + sum_t probs[r][t] * values[t] over key pairs
// [pair_begin, pair_end) (keys 2u, 2u + 1), values_p the rows interleaved in pairs (NV * 32
// uint16 per pair), the probabilities rounded to bfloat16.
template <int NV, int R>
void pair_values(const float* probs, int64_t prob_stride, const uint16_t* values_p,
                 int64_t pair_begin, int64_t pair_end, const float* correction, float* acc,
                 int64_t acc_stride) {
  __m512 a[R][NV];
  for (int r = 0; r < R; ++r) {
    const __m512 c = _mm512_set1_ps(correction[r]);
    for (int v = 0; v < NV; ++v) a[r][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * acc_stride + v * 16), c);
  }
  for (int64_t u = pair_begin; u < pair_end; ++u) {
    __m512bh x[NV];
    for (int v = 0; v < NV; ++v) x[v] = (__m512bh)_mm512_loadu_si512(values_p + (u * NV + v) * 32);
    for (int r = 0; r < R; ++r) {
      const float* p = probs + r * prob_stride + 2 * u;
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(bf16_pair(p[0], p[1])));
      for (int v = 0; v < NV; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], x[v], pb);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + r * acc_stride + v * 16, a[r][v]);
  }
}

using PairScoresFn = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, float, float*,
                              int64_t);
using PairValuesFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, int64_t,
                              const float*, float*, int64_t);

// The vdpbf16ps instantiations: scores[KV - 1][R - 1], values[NV / 2 - 1][R - 1].
struct PairOps {
  PairScoresFn scores[kMaxKeyVecs][kMaxTransposedRows];
  PairValuesFn values[kMaxVecs / 2][kMaxRows];
};

template <int KV, int... R>
void fill_pair_scores(PairOps& ops, std::integer_sequence<int, R...>) {
  ((ops.scores[KV - 1][R] = &pair_scores_transposed<KV, R + 1>), ...);
}

template <int NV, int... R>
void fill_pair_values(PairOps& ops, std::integer_sequence<int, R...>) {
  ((ops.values[NV / 2 - 1][R] = (R + 1 <= rows_per_pass(NV)) ? &pair_values<NV, R + 1> : nullptr), ...);
}

template <int... H>
PairOps make_pair_ops(std::integer_sequence<int, H...>) {  // H: NV / 2 - 1
  PairOps ops{};
  fill_pair_scores<1>(ops, std::make_integer_sequence<int, kMaxTransposedRows>{});
  fill_pair_scores<2>(ops, std::make_integer_sequence<int, kMaxTransposedRows>{});
  fill_pair_scores<3>(ops, std::make_integer_sequence<int, kMaxTransposedRows>{});
  fill_pair_scores<4>(ops, std::make_integer_sequence<int, kMaxTransposedRows>{});
  (fill_pair_values<2 * (H + 1)>(ops, std::make_integer_sequence<int, kMaxRows>{}), ...);
  return ops;
}

inline const PairOps& pair_ops() {
  static const PairOps ops = make_pair_ops(std::make_integer_sequence<int, kMaxVecs / 2>{});
  return ops;
}

}  // namespace
}  // namespace carpool_cpu
#endif
