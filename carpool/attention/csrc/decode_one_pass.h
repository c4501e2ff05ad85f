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
// are exact in float32, no conversion), and the value sums stay in float32.
//
// Per group of up to 16 keys of one block: each row's 16 dot products are folded into one
// vector of 16 scores by a transpose-add tree; the online softmax takes the group at once
// (the running max, the sum, and the float32 accumulators rescaled only when the max grows);
// the value rows are added with the probabilities (bfloat16 ones widened to float32 in
// registers, even and odd columns apart, see group_values).
// Keys outside [key_begin, key_end) are never read (the cache holds anything there).
//
// A row of head_dim values fills NL cache lines of 64 bytes: 16 float32 or 32 bfloat16 each.
// The element type is the pointers' (float, or uint16_t for bfloat16 bits).

#pragma once

#include "block_ops.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace carpool_cpu {
namespace {  // internal linkage, as in block_ops.h

constexpr int64_t kDecodeGroup = 16;  // keys per softmax step: one float32 vector of scores
constexpr int64_t kMaxDecodeDim = 256;  // head_dim up to this (kMaxVecs float32 vectors)

// Values of elem_t in one 64-byte cache line (and in one AVX512 register).
template <typename elem_t>
constexpr int64_t kLine = 64 / sizeof(elem_t);

// One request's decode against one kv head. Rows are the G query heads of that kv head.
template <typename elem_t>
struct DecodeArgs {
  const elem_t* q;         // row r's query at q + r * q_head_stride
  int64_t q_head_stride;
  const elem_t* key_head;  // this kv head's keys: block b's row t at (b * block_size + t) * D
  const elem_t* value_head;
  const int32_t* table;    // the request's block table
  int64_t num_cache_blocks, block_size, head_dim, rows;
  int64_t key_begin, key_end;  // the positions attended
  float scale;
  elem_t* out;  // row r's output at out + r * out_head_stride
  int64_t out_head_stride;
  int64_t seq;  // the request's index, for errors
};

// Per-thread state across a call's items.
struct DecodeScratch {
  std::vector<float> acc, probs, row_max, row_sum;
  void reserve(int64_t rows, int64_t head_dim) {
    if (static_cast<int64_t>(acc.size()) < rows * head_dim) acc.resize(rows * head_dim);
    if (static_cast<int64_t>(row_max.size()) < rows) {
      probs.resize(rows * kDecodeGroup);
      row_max.resize(rows);
      row_sum.resize(rows);
    }
  }
};

// Lane i of the result = the sum of the lanes of a[i].
// (always inlined, as the helpers below: an out-of-line call takes the 16 vectors through
// memory, 0.82x measured on bfloat16 decodes)
__attribute__((always_inline)) inline __m512 fold16(const __m512 (&a)[16]) {
  __m512 pair[8], quad[4], half[2];
  for (int i = 0; i < 8; ++i) {  // per 128 bits: [a0 l0+l2, a1 l0+l2, a0 l1+l3, a1 l1+l3]
    pair[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                            _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128 bits: keys 4i .. 4i + 3, each its lanes' sum
    const __m512d x = _mm512_castps_pd(pair[2 * i]), y = _mm512_castps_pd(pair[2 * i + 1]);
    quad[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                            _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i) {
    half[i] = _mm512_add_ps(
        _mm512_shuffle_f32x4(quad[2 * i], quad[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
        _mm512_shuffle_f32x4(quad[2 * i], quad[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(half[0], half[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(half[0], half[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// 16 keys' partial-sum vectors -> their scores, scaled; lanes from n on are -inf.
__attribute__((always_inline)) inline __m512 scaled_scores(const __m512 (&part)[16], int64_t n,
                                                           float scale) {
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  return _mm512_mask_mul_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid,
                            fold16(part), _mm512_set1_ps(scale));
}

// The n <= 16 scores of one query row (NL lines of D values) against the key rows at
// keys + t * D, t < n, scaled; lanes from n on are -inf. Key rows past n are not read.
template <int NL>
inline __m512 group_scores(const float* q, const float* keys, int64_t n, float scale) {
  constexpr int64_t D = 16 * NL;
  __m512 qv[NL];
  for (int p = 0; p < NL; ++p) qv[p] = _mm512_loadu_ps(q + 16 * p);
  __m512 part[16];
  for (int t = 0; t < 16; ++t) {
    const float* key = keys + std::min<int64_t>(t, n - 1) * D;
    __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(key));
    for (int p = 1; p < NL; ++p) a = _mm512_fmadd_ps(qv[p], _mm512_loadu_ps(key + 16 * p), a);
    part[t] = a;
  }
  return scaled_scores(part, n, scale);
}

#if defined(CARPOOL_AVX512_BF16)
template <int NP>
inline __m512 group_scores(const uint16_t* q, const uint16_t* keys, int64_t n, float scale) {
  constexpr int64_t D = 32 * NP;
  __m512bh qv[NP];
  for (int p = 0; p < NP; ++p) qv[p] = (__m512bh)_mm512_loadu_si512(q + 32 * p);
  __m512 part[16];
  for (int t = 0; t < 16; ++t) {
    const uint16_t* key = keys + std::min<int64_t>(t, n - 1) * D;
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(key));
    for (int p = 1; p < NP; ++p) {
      a = _mm512_dpbf16_ps(a, qv[p], (__m512bh)_mm512_loadu_si512(key + 32 * p));
    }
    part[t] = a;
  }
  return scaled_scores(part, n, scale);
}
#endif

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

// Value row `row` as D / 16 float32 vectors, in the column order group_values keeps the
// accumulators in: float32 rows as they are.
template <int NL>
__attribute__((always_inline)) inline void load_values(const float* row, __m512 (&x)[NL]) {
  for (int v = 0; v < NL; ++v) x[v] = _mm512_loadu_ps(row + 16 * v);
}

#if defined(CARPOOL_AVX512_BF16)
// bfloat16 rows: each 32 columns as their 16 even columns, then their 16 odd ones. A bfloat16
// pair's 32 bits become the even column's float by a shift and the odd one's by a mask (two
// operations for 32 columns, where widening in column order takes five); to_column_order
// puts the accumulators back in order at the end.
template <int NP>
__attribute__((always_inline)) inline void load_values(const uint16_t* row,
                                                       __m512 (&x)[2 * NP]) {
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int p = 0; p < NP; ++p) {
    const __m512i pairs = _mm512_loadu_si512(row + 32 * p);
    x[2 * p] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    x[2 * p + 1] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half));
  }
}
#endif

// acc[r] += sum_t probs[r][t] * values[t] for R rows and the n value rows at values + t * D;
// the next block's rows prefetched as they go (prefetch_rows_l1).
template <typename elem_t, int NL, int R>
void group_values(const float* probs, const elem_t* values, int64_t n, float* acc,
                  const elem_t* next_keys, const elem_t* next_values) {
  constexpr int64_t D = kLine<elem_t> * NL;
  constexpr int NV = D / 16;
  __m512 a[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) a[r][v] = _mm512_loadu_ps(acc + r * D + 16 * v);
  }
  for (int64_t t = 0; t < n; ++t) {
    prefetch_rows_l1<elem_t, NL>(next_keys, next_values, t);
    __m512 x[NV];
    load_values<NL>(values + t * D, x);
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(probs[r * kDecodeGroup + t]);
      for (int v = 0; v < NV; ++v) a[r][v] = _mm512_fmadd_ps(p, x[v], a[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + r * D + 16 * v, a[r][v]);
  }
}

// Float32 accumulators are in column order already.
template <int NL>
inline void to_column_order(float*, const float*) {}

#if defined(CARPOOL_AVX512_BF16)
// One row of D = 32 * NP accumulators from group_values' paired order back to column order.
template <int NP>
inline void to_column_order(float* row, const uint16_t*) {
  const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                          24, 8);
  for (int p = 0; p < NP; ++p) {
    const __m512 even = _mm512_loadu_ps(row + 32 * p), odd = _mm512_loadu_ps(row + 32 * p + 16);
    _mm512_storeu_ps(row + 32 * p, _mm512_permutex2var_ps(even, first, odd));
    _mm512_storeu_ps(row + 32 * p + 16, _mm512_permutex2var_ps(even, second, odd));
  }
}
#endif

template <typename elem_t, int NL, int... R>
void group_values_rows(const float* probs, const elem_t* values, int64_t n, float* acc,
                       int64_t rows, std::integer_sequence<int, R...>, const elem_t* next_keys,
                       const elem_t* next_values) {
  constexpr int64_t D = kLine<elem_t> * NL;
  constexpr int kPass = rows_per_pass(D / 16);  // block_ops.h: accumulators in registers
  using Fn = void (*)(const float*, const elem_t*, int64_t, float*, const elem_t*,
                      const elem_t*);
  static constexpr Fn fns[] = {&group_values<elem_t, NL, R + 1>...};
  for (int64_t r0 = 0; r0 < rows; r0 += kPass) {  // the first pass prefetches
    const int64_t m = std::min<int64_t>(kPass, rows - r0);
    const bool first = r0 == 0;
    fns[m - 1](probs + r0 * kDecodeGroup, values, n, acc + r0 * D,
               first ? next_keys : nullptr, first ? next_values : nullptr);
  }
}

inline void prefetch_block_l1(const void* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// Whether attend_decode also prefetches the block after next into L2. On AMD's Zen 4 the
// one-block-ahead L1 prefetches alone leave the reads and the arithmetic nearly serial
// (decode_read_rate.py from memory: 14-16 GB/s, 19-23 with this, 24-27 read-only); on
// Intel's Sapphire Rapids L2 prefetches ahead of the L1 ones cost 5-10% (BENCHMARKS §28).
inline bool prefetch_block_after_next() {
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
}

// `bytes` of keys and of values into L2, a line of each in turn.
inline void prefetch_block_l2(const void* keys, const void* values, int64_t bytes) {
  const char* k = reinterpret_cast<const char*>(keys);
  const char* v = reinterpret_cast<const char*>(values);
  for (int64_t i = 0; i < bytes; i += 64) {
    _mm_prefetch(k + i, _MM_HINT_T1);
    _mm_prefetch(v + i, _MM_HINT_T1);
  }
}

// The id at table entry b; raises when it is outside the cache.
template <typename elem_t>
inline int64_t checked_block(const DecodeArgs<elem_t>& a, int64_t b) {
  const int64_t block = a.table[b];
  TORCH_CHECK(block >= 0 && block < a.num_cache_blocks, "paged_attention: block id ", block,
              " of request ", a.seq, " is outside the cache (", a.num_cache_blocks, " blocks)");
  return block;
}

// The first block of `a` (keys and values) into L1: the thread's next item, while the last
// block of its current one is attended.
template <typename elem_t, int NL>
inline void prefetch_first_block(const DecodeArgs<elem_t>& a) {
  constexpr int64_t D = kLine<elem_t> * NL;
  const int64_t b = a.key_begin / a.block_size, block = a.table[b];
  if (block < 0 || block >= a.num_cache_blocks) return;  // attend_decode raises on it
  const int64_t first = a.key_begin - b * a.block_size;
  const int64_t n = std::min(a.block_size - first, a.key_end - a.key_begin);
  const int64_t offset = (block * a.block_size + first) * D;
  prefetch_block_l1(a.key_head + offset, n * D * sizeof(elem_t));
  prefetch_block_l1(a.value_head + offset, n * D * sizeof(elem_t));
}

inline float* output_row(float* p) { return p; }
inline at::BFloat16* output_row(uint16_t* p) { return reinterpret_cast<at::BFloat16*>(p); }

template <typename elem_t, int NL>
void attend_decode(const DecodeArgs<elem_t>& a, const DecodeArgs<elem_t>* next_item,
                   DecodeScratch& buf) {
  constexpr int64_t D = kLine<elem_t> * NL;
  const int64_t G = a.rows, BS = a.block_size;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  buf.reserve(G, D);
  float* acc = buf.acc.data();
  std::fill(acc, acc + G * D, 0.f);
  std::fill(buf.row_max.begin(), buf.row_max.begin() + G, kNegInf);
  std::fill(buf.row_sum.begin(), buf.row_sum.begin() + G, 0.f);
  const int64_t first_block = a.key_begin / BS, end_block = (a.key_end + BS - 1) / BS;
  const bool l2_ahead = prefetch_block_after_next();
  int64_t block = checked_block(a, first_block);
  for (int64_t b = first_block; b < end_block; ++b) {
    int64_t next = -1;  // the next block's id
    const elem_t* next_keys = nullptr;  // its rows, prefetched while this block is attended
    const elem_t* next_values = nullptr;
    if (b + 1 < end_block) {
      next = checked_block(a, b + 1);
      next_keys = a.key_head + next * BS * D;
      next_values = a.value_head + next * BS * D;
    } else if (next_item != nullptr) {
      prefetch_first_block<elem_t, NL>(*next_item);
    }
    if (l2_ahead && b + 2 < end_block) {  // an id outside the cache raises when reached
      const int64_t far = a.table[b + 2];
      if (far >= 0 && far < a.num_cache_blocks) {
        prefetch_block_l2(a.key_head + far * BS * D, a.value_head + far * BS * D,
                          BS * D * sizeof(elem_t));
      }
    }
    const int64_t lo = std::max(a.key_begin, b * BS), hi = std::min(a.key_end, (b + 1) * BS);
    for (int64_t t0 = lo; t0 < hi; t0 += kDecodeGroup) {
      const int64_t n = std::min(kDecodeGroup, hi - t0);
      const int64_t offset = (block * BS + t0 - b * BS) * D;
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
      for (int64_t r = 0; r < G; ++r) {
        const __m512 s = group_scores<NL>(a.q + r * a.q_head_stride, a.key_head + offset, n,
                                          a.scale);
        const float group_max = _mm512_reduce_max_ps(s);
        if (group_max > buf.row_max[r]) {  // rescale what the row accumulated so far
          const float c = buf.row_max[r] == kNegInf ? 0.f : std::exp(buf.row_max[r] - group_max);
          const __m512 cv = _mm512_set1_ps(c);
          for (int64_t d = 0; d < D; d += 16) {
            _mm512_storeu_ps(acc + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), cv));
          }
          buf.row_sum[r] *= c;
          buf.row_max[r] = group_max;
        }
        const __m512 p = _mm512_maskz_mov_ps(valid, at::vec::Vectorized<float>(
            _mm512_sub_ps(s, _mm512_set1_ps(buf.row_max[r]))).exp_u20());
        buf.row_sum[r] += _mm512_reduce_add_ps(p);
        _mm512_storeu_ps(buf.probs.data() + r * kDecodeGroup, p);
      }
      // The next block's rows t0 - lo ... t0 - lo + n - 1 with this group's value rows (rows of
      // a whole cache block: at most block_size of them, whatever they hold).
      const int64_t ahead = (t0 - lo) * D;
      group_values_rows<elem_t, NL>(buf.probs.data(), a.value_head + offset, n, acc, G,
                                    std::make_integer_sequence<int, rows_per_pass(D / 16)>{},
                                    next_keys != nullptr ? next_keys + ahead : nullptr,
                                    next_values != nullptr ? next_values + ahead : nullptr);
    }
    block = next;
  }
  for (int64_t r = 0; r < G; ++r) {
    to_column_order<NL>(acc + r * D, a.value_head);
    store_scaled(acc + r * D, 1.f / buf.row_sum[r], output_row(a.out + r * a.out_head_stride), D);
  }
}

// Whether attend_decode_one_pass takes this head_dim for elements of elem_t.
template <typename elem_t>
inline bool decode_one_pass_head_dim_ok(int64_t head_dim) {
  return head_dim % kLine<elem_t> == 0 && head_dim <= kMaxDecodeDim;
}

template <typename elem_t, int... NL>
void attend_decode_lines(const DecodeArgs<elem_t>& a, const DecodeArgs<elem_t>* next_item,
                         DecodeScratch& buf, std::integer_sequence<int, NL...>) {
  using Fn = void (*)(const DecodeArgs<elem_t>&, const DecodeArgs<elem_t>*, DecodeScratch&);
  static constexpr Fn fns[] = {&attend_decode<elem_t, NL + 1>...};
  TORCH_CHECK(decode_one_pass_head_dim_ok<elem_t>(a.head_dim),
              "attend_decode_one_pass: head_dim ", a.head_dim, " not taken");
  fns[a.head_dim / kLine<elem_t> - 1](a, next_item, buf);
}

// next_item: the thread's next decode (its first block is prefetched at the end), or null.
template <typename elem_t>
inline void attend_decode_one_pass(const DecodeArgs<elem_t>& a,
                                   const DecodeArgs<elem_t>* next_item, DecodeScratch& buf) {
  attend_decode_lines(a, next_item, buf,
                      std::make_integer_sequence<int, kMaxDecodeDim / kLine<elem_t>>{});
}

}  // namespace
}  // namespace carpool_cpu
#endif
