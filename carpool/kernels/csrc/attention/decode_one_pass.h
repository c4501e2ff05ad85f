// Decode attention in a single pass: one query position of one request against its keys, for
// the G query heads sharing one kv head. Float32 caches on AVX512 CPUs, bfloat16 caches on
// those with AVX512-BF16.
//
// Why its own loop: a decode reads every key and value once and does little arithmetic per
// byte, so it runs at the speed memory delivers the request's blocks, which sit anywhere in
// the cache. The general loop (paged_attention.cpp) gathers 64-key chunks into pointer
// tables, then makes one pass for the scores and one for the values with software
// prefetches two chunks ahead; measured, it stalls on memory at about a third of what these
// cores stream (and for the few-key blocks of a small head_dim, its per-key pointer tables
// cost more than the arithmetic). Here each cache block is attended whole while the next one
// is prefetched into L1, a few lines per key inside the value loop (one block ahead: farther
// ahead, or all of a block's lines at once, the prefetches wait for fill buffers and stall
// the loop; on AMD the block after next goes into L2 as well, see prefetch_block_after_next),
// scores come from the keys in place (bfloat16 through vdpbf16ps: products of bfloat16 pairs
// are exact in float32, no conversion; or, on Intel, each row widened to float32 once for
// FMAs, widen_bf16_decodes), and the value sums are kept in float32.
//
// Per group of up to 16 keys of one block: each key row is loaded once for up to 4 query rows,
// and each row's 16 dot products are folded into one vector of 16 scores by a transpose-add
// tree; the online softmax takes the group at once (a running max that moves only when a
// score passes it by more than kMaxSlack, a vector of sums, and the float32 accumulators
// rescaled only when the max moves);
// the value rows are added with the probabilities (float32 rows by FMAs; bfloat16 rows two
// keys at a time through vdpbf16ps, with the probabilities rounded to bfloat16 as bfloat16
// SDPA kernels and prefill_attention.cpp do, see group_values_bf16).
// Keys outside [key_begin, key_end) are never read (the cache holds anything there).
//
// A row of head_dim values fills NL cache lines of 64 bytes: 16 float32 or 32 bfloat16 each.
// The element type is the pointers' (float, or uint16_t for bfloat16 bits).

#pragma once

#include "attention/decode_common.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace carpool_cpu {
namespace {  // internal linkage, as in block_ops.h

constexpr int64_t kMaxDecodeDim = 256;  // head_dim up to this (kMaxVecs float32 vectors)

// The transpose-add tree that turns 16 keys' partial-sum vectors into one vector of 16 scores
// (lane t: the sum of the lanes of key t's vector), one level at a time, so that group_scores
// can fold keys as it goes instead of holding 16 vectors for each row. Each level adds two
// neighbours of the level below, in key order.
// (always inlined, as the helpers below: an out-of-line call takes vectors through memory,
// 0.82x measured on bfloat16 decodes)
__attribute__((always_inline)) inline __m512 fold_keys(__m512 a, __m512 b) {
  // per 128 bits: [a l0+l2, b l0+l2, a l1+l3, b l1+l3]
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
__attribute__((always_inline)) inline __m512 fold_pairs(__m512 a, __m512 b) {
  // per 128 bits: keys 4i .. 4i + 3, each its lanes' sum
  const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
__attribute__((always_inline)) inline __m512 fold_quads(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
__attribute__((always_inline)) inline __m512 fold_halves(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// One key row's products with R query rows, as partial-sum vectors: float32 rows by FMAs,
// bfloat16 rows by vdpbf16ps (products of bfloat16 pairs are exact in float32).
template <typename elem_t, int NL>
struct QueryRows;

template <int NL>
struct QueryRows<float, NL> {
  using Vec = __m512;
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 first(Vec q, Vec k) { return _mm512_mul_ps(q, k); }
  static __m512 add(__m512 a, Vec q, Vec k) { return _mm512_fmadd_ps(q, k, a); }
};

#if defined(CARPOOL_AVX512_BF16)
template <int NL>
struct QueryRows<uint16_t, NL> {
  using Vec = __m512bh;
  static Vec load(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512 first(Vec q, Vec k) { return _mm512_dpbf16_ps(_mm512_setzero_ps(), q, k); }
  static __m512 add(__m512 a, Vec q, Vec k) { return _mm512_dpbf16_ps(a, q, k); }
};
#endif

// Bfloat16 rows widened to float32 instead, each line as its even and its odd values (a shift
// and a mask: bfloat16 is the top half of a float32, so both are exact), multiplied by FMAs:
// where two FMAs issue a cycle and one vdpbf16ps every two or three (Intel's Emerald Rapids,
// bf16_peak.py), each key row widened once for all R rows (widen_bf16_decodes).
struct Bf16Halves {
  __m512 even, odd;
};

__attribute__((always_inline)) inline Bf16Halves widened(const uint16_t* p) {
  const __m512i v = _mm512_loadu_si512(p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
          _mm512_castsi512_ps(
              _mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
}

template <int NL>
struct WidenedRows {
  using Vec = Bf16Halves;
  static Vec load(const uint16_t* p) { return widened(p); }
  static __m512 first(Vec q, Vec k) {
    return _mm512_fmadd_ps(q.odd, k.odd, _mm512_mul_ps(q.even, k.even));
  }
  static __m512 add(__m512 a, Vec q, Vec k) {
    return _mm512_fmadd_ps(q.odd, k.odd, _mm512_fmadd_ps(q.even, k.even, a));
  }
};

// The score ops of elem_t rows: W (bfloat16 only) widens them to float32.
template <typename elem_t, int NL, bool W>
using RowOps = std::conditional_t<W, WidenedRows<NL>, QueryRows<elem_t, NL>>;

// Whether bfloat16 decodes widen their rows to float32 for FMAs (WidenedRows) instead of
// vdpbf16ps. Intel issues vdpbf16ps at a fraction of its FMA rate, so the widened loop is
// faster there (docs/lab/42-an-emerald-rapids-vm-with-vllm-cpu.md). AMD's Zen 4 keeps vdpbf16ps: it issues one a cycle there, as many
// as 512-bit FMAs.
inline bool widen_bf16_decodes() {
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
}

template <typename elem_t, int NL, bool W, int R>
__attribute__((always_inline)) inline void key_partials(
    const typename RowOps<elem_t, NL, W>::Vec (&qv)[R][NL], const elem_t* key, __m512 (&part)[R]) {
  using Ops = RowOps<elem_t, NL, W>;
  typename Ops::Vec kv[NL];
  for (int p = 0; p < NL; ++p) kv[p] = Ops::load(key + kLine<elem_t> * p);
  for (int r = 0; r < R; ++r) {
    __m512 a = Ops::first(qv[r][0], kv[0]);
    for (int p = 1; p < NL; ++p) a = Ops::add(a, qv[r][p], kv[p]);
    part[r] = a;
  }
}

// Scores of R query rows (row r at q + r * q_stride, NL lines of D values) against the n <= 16
// key rows at keys + t * D, scaled, into scores[r * 16 ...]; lanes from n on are -inf. Each
// key row is loaded once for all R rows (not once per row), and key rows past n are not read.
template <typename elem_t, int NL, bool W, int R>
void group_scores(const elem_t* q, int64_t q_stride, const elem_t* keys, int64_t n, float scale,
                  float* scores) {
  using Ops = RowOps<elem_t, NL, W>;
  constexpr int64_t D = kLine<elem_t> * NL;
  typename Ops::Vec qv[R][NL];
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < NL; ++p) qv[r][p] = Ops::load(q + r * q_stride + kLine<elem_t> * p);
  }
  auto partials = [&](int t, __m512 (&part)[R]) {
    key_partials<elem_t, NL, W, R>(qv, keys + std::min<int64_t>(t, n - 1) * D, part);
  };
  __m512 half[2][R];
  for (int h = 0; h < 2; ++h) {
    __m512 quad[2][R];
    for (int c = 0; c < 2; ++c) {
      __m512 pair[2][R];
      for (int i = 0; i < 2; ++i) {
        const int t = 8 * h + 4 * c + 2 * i;
        __m512 even[R], odd[R];
        partials(t, even);
        partials(t + 1, odd);
        for (int r = 0; r < R; ++r) pair[i][r] = fold_keys(even[r], odd[r]);
      }
      for (int r = 0; r < R; ++r) quad[c][r] = fold_pairs(pair[0][r], pair[1][r]);
    }
    for (int r = 0; r < R; ++r) half[h][r] = fold_quads(quad[0][r], quad[1][r]);
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(scores + r * kDecodeGroup,
                     _mm512_mask_mul_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                        valid, fold_halves(half[0][r], half[1][r]),
                                        _mm512_set1_ps(scale)));
  }
}

// Whether a group's scores move the running max m: the probabilities are exp(score - m) for
// an m that moves only when a score exceeds it by more than kMaxSlack (so they stay below
// e^kMaxSlack), so most groups skip the horizontal max and the rescale; the slack cancels in
// the final division. True for any score while m is -inf.
__attribute__((always_inline)) inline bool passes_running_max(__m512 scores, float m) {
  return _mm512_cmp_ps_mask(scores, _mm512_set1_ps(m + kMaxSlack), _CMP_GT_OQ) != 0;
}

// Query rows per group_scores pass: their query vectors stay in registers with the key row's
// and the partial sums of two keys.
constexpr int score_rows_per_pass(int num_vecs) {
  return std::max(1, std::min(4, (kVecRegisters - 8) / (num_vecs + 4)));
}

// Float32 registers a query row's line takes in group_scores (widened bfloat16: two).
template <int NL, bool W>
constexpr int kScoreVecs = W ? 2 * NL : NL;

// group_scores for `rows` query rows, in passes of score_rows_per_pass.
template <typename elem_t, int NL, bool W, int... R>
void group_scores_rows(const elem_t* q, int64_t q_stride, const elem_t* keys, int64_t n,
                       float scale, float* scores, int64_t rows, std::integer_sequence<int, R...>) {
  using Fn = void (*)(const elem_t*, int64_t, const elem_t*, int64_t, float, float*);
  static constexpr Fn fns[] = {&group_scores<elem_t, NL, W, R + 1>...};
  constexpr int kPass = sizeof...(R);
  for (int64_t r0 = 0; r0 < rows; r0 += kPass) {
    const int64_t m = std::min<int64_t>(kPass, rows - r0);
    fns[m - 1](q + r0 * q_stride, q_stride, keys, n, scale, scores + r0 * kDecodeGroup);
  }
}

// The lines of key row t and value row t of the next block (both null: none) into L1, with
// value row t: a block's prefetches spread over the loop instead of waiting in a burst for
// fill buffers.
template <typename elem_t, int NL>
__attribute__((always_inline)) inline void prefetch_rows_l1(const elem_t* next_keys,
                                                            const elem_t* next_values, int64_t t) {
  if (next_keys == nullptr) return;
  constexpr int64_t D = kLine<elem_t> * NL;
  for (int p = 0; p < NL; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(next_keys + t * D + kLine<elem_t> * p),
                 _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(next_values + t * D + kLine<elem_t> * p),
                 _MM_HINT_T0);
  }
}

#if defined(CARPOOL_AVX512_BF16)
// x rounded to the nearest bfloat16 values (vcvtneps2bf16), as float32.
__attribute__((always_inline)) inline __m512 rounded_to_bf16(__m512 x) {
  const __m256i bits = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

// acc[r] += sum_t probs[r][t] * values[t] for R rows and the n value rows at values + t * D;
// the next block's rows prefetched as they go (prefetch_rows_l1). Float32 rows: one FMA per
// row and vector.
template <int NL, int R>
__attribute__((always_inline)) inline void group_values_f32(
    const float* probs, const float* values, int64_t n, __m512 (&a)[R][NL],
    const float* next_keys, const float* next_values) {
  constexpr int64_t D = 16 * NL;
  for (int64_t t = 0; t < n; ++t) {
    prefetch_rows_l1<float, NL>(next_keys, next_values, t);
    __m512 x[NL];
    for (int v = 0; v < NL; ++v) x[v] = _mm512_loadu_ps(values + t * D + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(probs[r * kDecodeGroup + t]);
      for (int v = 0; v < NL; ++v) a[r][v] = _mm512_fmadd_ps(p, x[v], a[r][v]);
    }
  }
}

#if defined(CARPOOL_AVX512_BF16)
// Bfloat16 rows by pairs of keys: rows t and t + 1 interleaved column by column (one unpack
// per 16 columns), so one vdpbf16ps adds both keys' products for 16 columns against the two
// probabilities broadcast as one bfloat16 pair: half the arithmetic of widening every row to
// float32 and a FMA per key. The probabilities must be bfloat16 values already (attend_decode
// rounds them, and sums the rounded ones). An odd last key pairs with zeros, never with the
// row after it (the cache holds anything there). Each 32 columns' accumulators come out as
// their unpacked low halves, then their high halves: to_column_order puts them in order.
template <int NP, int R>
__attribute__((always_inline)) inline void group_values_bf16(
    const float* probs, const uint16_t* values, int64_t n, __m512 (&a)[R][2 * NP],
    const uint16_t* next_keys, const uint16_t* next_values) {
  constexpr int64_t D = 32 * NP;
  uint32_t pairs[R][kDecodeGroup / 2];  // row r's probabilities of keys 2j, 2j + 1
  for (int r = 0; r < R; ++r) {
    const __m256bh p = _mm512_cvtneps_pbh(_mm512_loadu_ps(probs + r * kDecodeGroup));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs[r]), (__m256i)p);
  }
  for (int64_t t = 0; t < n; t += 2) {
    prefetch_rows_l1<uint16_t, NP>(next_keys, next_values, t);
    const bool whole = t + 1 < n;
    if (whole) prefetch_rows_l1<uint16_t, NP>(next_keys, next_values, t + 1);
    __m512i x[2 * NP];
    for (int p = 0; p < NP; ++p) {
      const __m512i first = _mm512_loadu_si512(values + t * D + 32 * p);
      const __m512i second = whole ? _mm512_loadu_si512(values + (t + 1) * D + 32 * p)
                                   : _mm512_setzero_si512();
      x[2 * p] = _mm512_unpacklo_epi16(first, second);
      x[2 * p + 1] = _mm512_unpackhi_epi16(first, second);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r][t / 2]));
      for (int v = 0; v < 2 * NP; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], p, (__m512bh)x[v]);
    }
  }
}
#endif

// acc[r] += sum_t probs[r][t] * values[t] for widened bfloat16 rows (Bf16Halves): one FMA per
// row and float32 vector, the accumulators of each line's even columns, then its odd ones
// (to_column_order puts them in order); float32 probabilities (not rounded to bfloat16).
template <int NP, int R>
__attribute__((always_inline)) inline void group_values_widened(
    const float* probs, const uint16_t* values, int64_t n, __m512 (&a)[R][2 * NP],
    const uint16_t* next_keys, const uint16_t* next_values) {
  constexpr int64_t D = 32 * NP;
  for (int64_t t = 0; t < n; ++t) {
    prefetch_rows_l1<uint16_t, NP>(next_keys, next_values, t);
    __m512 x[2 * NP];
    for (int p = 0; p < NP; ++p) {
      const Bf16Halves h = widened(values + t * D + 32 * p);
      x[2 * p] = h.even;
      x[2 * p + 1] = h.odd;
    }
    for (int r = 0; r < R; ++r) {
      const __m512 pv = _mm512_set1_ps(probs[r * kDecodeGroup + t]);
      for (int v = 0; v < 2 * NP; ++v) a[r][v] = _mm512_fmadd_ps(pv, x[v], a[r][v]);
    }
  }
}

template <typename elem_t, int NL, bool W, int R>
void group_values(const float* probs, const elem_t* values, int64_t n, float* acc,
                  const elem_t* next_keys, const elem_t* next_values) {
  constexpr int64_t D = kLine<elem_t> * NL;
  constexpr int NV = D / 16;
  __m512 a[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) a[r][v] = _mm512_loadu_ps(acc + r * D + 16 * v);
  }
  if constexpr (std::is_same_v<elem_t, float>) {
    group_values_f32<NL, R>(probs, values, n, a, next_keys, next_values);
  } else {
#if defined(CARPOOL_AVX512_BF16)
    if constexpr (W) {
      group_values_widened<NL, R>(probs, values, n, a, next_keys, next_values);
    } else {
      group_values_bf16<NL, R>(probs, values, n, a, next_keys, next_values);
    }
#endif
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + r * D + 16 * v, a[r][v]);
  }
}

// Float32 accumulators are in column order already.
template <int NL, bool W>
inline void to_column_order(float*, const float*) {}

#if defined(CARPOOL_AVX512_BF16)
// One row of D = 32 * NP accumulators back to column order, each 32 columns from two vectors
// by two permutes. group_values_bf16's unpacked order: lane 4L + i of the low halves is column
// 8L + i, of the high halves column 8L + 4 + i (i < 4); group_values_widened's (W): the 16
// even columns, then the 16 odd ones.
template <int NP, bool W>
inline void to_column_order(float* row, const uint16_t*) {
  const __m512i first =
      W ? _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0)
        : _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second =
      W ? _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8)
        : _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int p = 0; p < NP; ++p) {
    const __m512 a = _mm512_loadu_ps(row + 32 * p), b = _mm512_loadu_ps(row + 32 * p + 16);
    _mm512_storeu_ps(row + 32 * p, _mm512_permutex2var_ps(a, first, b));
    _mm512_storeu_ps(row + 32 * p + 16, _mm512_permutex2var_ps(a, second, b));
  }
}
#endif

template <typename elem_t, int NL, bool W, int... R>
void group_values_rows(const float* probs, const elem_t* values, int64_t n, float* acc,
                       int64_t rows, std::integer_sequence<int, R...>, const elem_t* next_keys,
                       const elem_t* next_values) {
  constexpr int64_t D = kLine<elem_t> * NL;
  constexpr int kPass = rows_per_pass(D / 16);  // block_ops.h: accumulators in registers
  using Fn = void (*)(const float*, const elem_t*, int64_t, float*, const elem_t*,
                      const elem_t*);
  static constexpr Fn fns[] = {&group_values<elem_t, NL, W, R + 1>...};
  for (int64_t r0 = 0; r0 < rows; r0 += kPass) {  // the first pass prefetches
    const int64_t m = std::min<int64_t>(kPass, rows - r0);
    const bool first = r0 == 0;
    fns[m - 1](probs + r0 * kDecodeGroup, values, n, acc + r0 * D,
               first ? next_keys : nullptr, first ? next_values : nullptr);
  }
}

template <typename elem_t, int NL, bool W>
void attend_decode(const DecodeArgs<elem_t>& a, const DecodeArgs<elem_t>* next_item,
                   DecodeScratch& buf) {
  constexpr int64_t D = kLine<elem_t> * NL;
  const int64_t G = a.rows, BS = a.block_size;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  buf.reserve(G, D);
  float* acc = buf.acc.data();
  std::fill(acc, acc + G * D, 0.f);
  std::fill(buf.row_max.begin(), buf.row_max.begin() + G, kNegInf);
  std::fill(buf.row_sum.begin(), buf.row_sum.begin() + G * kDecodeGroup, 0.f);
  const int64_t first_block = a.key_begin / BS, end_block = (a.key_end + BS - 1) / BS;
  const bool l2_ahead = prefetch_block_after_next();
  int64_t block = checked_block(a, first_block);
  for (int64_t b = first_block; b < end_block; ++b) {
    const NextBlock<elem_t> next = look_ahead(a, b, end_block, l2_ahead, next_item);
    const int64_t lo = std::max(a.key_begin, b * BS), hi = std::min(a.key_end, (b + 1) * BS);
    for (int64_t t0 = lo; t0 < hi; t0 += kDecodeGroup) {
      const int64_t n = std::min(kDecodeGroup, hi - t0);
      const int64_t offset = (block * BS + t0 - b * BS) * D;
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
      group_scores_rows<elem_t, NL, W>(
          a.q, a.q_head_stride, a.key_head + offset, n, a.scale, buf.scores.data(), G,
          std::make_integer_sequence<int, score_rows_per_pass(kScoreVecs<NL, W>)>{});
      for (int64_t r = 0; r < G; ++r) {
        const __m512 s = _mm512_loadu_ps(buf.scores.data() + r * kDecodeGroup);
        float* sum = buf.row_sum.data() + r * kDecodeGroup;  // a vector of partial sums
        if (passes_running_max(s, buf.row_max[r])) {
          const float group_max = _mm512_reduce_max_ps(s);
          const float c = buf.row_max[r] == kNegInf ? 0.f : std::exp(buf.row_max[r] - group_max);
          const __m512 cv = _mm512_set1_ps(c);
          for (int64_t d = 0; d < D; d += 16) {
            _mm512_storeu_ps(acc + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), cv));
          }
          _mm512_storeu_ps(sum, _mm512_mul_ps(_mm512_loadu_ps(sum), cv));
          buf.row_max[r] = group_max;
        }
        __m512 p = _mm512_maskz_mov_ps(valid, at::vec::Vectorized<float>(
            _mm512_sub_ps(s, _mm512_set1_ps(buf.row_max[r]))).exp_u20());
#if defined(CARPOOL_AVX512_BF16)
        // bfloat16 values: the probabilities group_values_bf16 multiplies, and sums of them
        if constexpr (std::is_same_v<elem_t, uint16_t> && !W) p = rounded_to_bf16(p);
#endif
        _mm512_storeu_ps(sum, _mm512_add_ps(_mm512_loadu_ps(sum), p));
        _mm512_storeu_ps(buf.probs.data() + r * kDecodeGroup, p);
      }
      // The next block's rows t0 - lo ... t0 - lo + n - 1 with this group's value rows (rows of
      // a whole cache block: at most block_size of them, whatever they hold).
      const int64_t ahead = (t0 - lo) * D;
      group_values_rows<elem_t, NL, W>(buf.probs.data(), a.value_head + offset, n, acc, G,
                                    std::make_integer_sequence<int, rows_per_pass(D / 16)>{},
                                    next.keys != nullptr ? next.keys + ahead : nullptr,
                                    next.values != nullptr ? next.values + ahead : nullptr);
    }
    block = next.id;
  }
  for (int64_t r = 0; r < G; ++r) {
    to_column_order<NL, W>(acc + r * D, a.value_head);
    const float sum = _mm512_reduce_add_ps(_mm512_loadu_ps(buf.row_sum.data() + r * kDecodeGroup));
    store_scaled(acc + r * D, 1.f / sum, output_row(a.out + r * a.out_head_stride), D);
  }
}

// Whether attend_decode_one_pass takes this head_dim for elements of elem_t.
template <typename elem_t>
inline bool decode_one_pass_head_dim_ok(int64_t head_dim) {
  return head_dim % kLine<elem_t> == 0 && head_dim <= kMaxDecodeDim;
}

template <typename elem_t, bool W, int... NL>
void attend_decode_lines(const DecodeArgs<elem_t>& a, const DecodeArgs<elem_t>* next_item,
                         DecodeScratch& buf, std::integer_sequence<int, NL...>) {
  using Fn = void (*)(const DecodeArgs<elem_t>&, const DecodeArgs<elem_t>*, DecodeScratch&);
  static constexpr Fn fns[] = {&attend_decode<elem_t, NL + 1, W>...};
  TORCH_CHECK(decode_one_pass_head_dim_ok<elem_t>(a.head_dim),
              "attend_decode_one_pass: head_dim ", a.head_dim, " not taken");
  fns[a.head_dim / kLine<elem_t> - 1](a, next_item, buf);
}

// next_item: the thread's next decode (its first block is prefetched at the end), or null.
template <typename elem_t>
inline void attend_decode_one_pass(const DecodeArgs<elem_t>& a,
                                   const DecodeArgs<elem_t>* next_item, DecodeScratch& buf) {
  constexpr auto lines = std::make_integer_sequence<int, kMaxDecodeDim / kLine<elem_t>>{};
  if constexpr (std::is_same_v<elem_t, uint16_t>) {
    const bool widen = buf.widen_bf16 < 0 ? widen_bf16_decodes() : buf.widen_bf16 == 1;
    if (widen) return attend_decode_lines<elem_t, true>(a, next_item, buf, lines);
  }
  attend_decode_lines<elem_t, false>(a, next_item, buf, lines);
}

}  // namespace
}  // namespace carpool_cpu
#endif
