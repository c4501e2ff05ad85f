// Decode attention in a single pass on AVX2 CPUs (no AVX512: Intel's client cores, AMD's Zen 2
// and 3): decode_one_pass.h's loop in registers of 8 floats, for float32 and bfloat16 caches of
// head_dim a multiple of 16, up to 128 (the most an AVX2 build takes, block_ops.h's kMaxVecs).
//
// Why its own loop: without it an AVX2 build attends decodes with the general chunked loop
// (paged_attention.cpp), far slower than the AVX512 one-pass loop on the same cores
// (docs/lab/33-decode-loops.md), for the reasons decode_one_pass.h gives. The plan is that loop's: each
// cache block attended whole while the next one is prefetched into L1 a row at a time inside
// the value loop (and on AMD the block after next into L2), scores from the keys in place, an
// online softmax per group with a lazy running max, float32 value sums. What AVX2 changes:
// - 16 vector registers, no mask registers and no bfloat16 dot products. A row is read in
//   chunks of 16 values, each as two float32 vectors (load_chunk): float32 as its two halves,
//   bfloat16 as its even and its odd values (a shift and a mask: bfloat16 is the top half of a
//   float32, so both are exact, and no shuffle is needed). The query rows are put in the same
//   layout once per item, so a dot product pairs the same elements; the value accumulators are
//   in it too and go back to column order at the end (to_column_order8). The probabilities
//   stay float32.
// - A softmax step is a group of 8 keys (one vector of scores, three levels of the
//   transpose-add tree, block_ops.h's fold_keys8 and the next two).
// - Scores: keys 2 at a time (4 for one or two query rows), each key chunk loaded (and
//   split) once for up to kScoreRows8 query rows and each query chunk (from L1) once for
//   those keys; the softmax step follows in registers (softmax_step8). Values: column chunk by column chunk, the accumulators of up
//   to kValueRows8 rows stay in registers across the group's keys, so each value chunk is
//   loaded and split once for all of them.
// Keys outside [key_begin, key_end) are never read (the cache holds anything there).

#pragma once

#include "attention/decode_common.h"

#if defined(CPU_CAPABILITY_AVX2)
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

namespace carpool_cpu {
namespace {  // internal linkage, as in block_ops.h

constexpr int64_t kGroup8 = 8;    // keys per softmax step: one vector of scores
constexpr int64_t kChunk = 16;    // values per chunk of a row: two float32 vectors
constexpr int64_t kMaxDecodeDim = 128;
constexpr int kScoreRows8 = 3;    // query rows per pass over a group's keys
constexpr int kValueRows8 = 6;    // rows of accumulators (2 vectors each) per value pass

// Half h of the 16 values at p as a float32 vector: float32 values 8h .. 8h + 7, bfloat16
// values h, h + 2, ..., h + 14.
__attribute__((always_inline)) inline __m256 load_half(const float* p, int h) {
  return _mm256_loadu_ps(p + 8 * h);
}
__attribute__((always_inline)) inline __m256 load_half(const uint16_t* p, int h) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_castsi256_ps(h == 0 ? _mm256_slli_epi32(x, 16)
                                    : _mm256_and_si256(x, _mm256_set1_epi32(
                                                              static_cast<int>(0xffff0000u))));
}

// The 16 values at p as two float32 vectors (load_half's two halves).
template <typename elem_t>
__attribute__((always_inline)) inline void load_chunk(const elem_t* p, __m256& a, __m256& b) {
  a = load_half(p, 0);
  b = load_half(p, 1);
}

// All ones in the lanes below n.
__attribute__((always_inline)) inline __m256 first_lanes(int64_t n) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

__attribute__((always_inline)) inline float reduce_max8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

__attribute__((always_inline)) inline float reduce_add8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The running state of a decode's softmax, per query row: max, 8 partial sums of the
// probabilities, and the value accumulators (D floats a row).
struct SoftmaxRows8 {
  float* row_max;
  float* row_sum;
  float* acc;
  int64_t D;
};

// One softmax step of R rows' scores s (lanes past the group's keys -inf), in registers:
// decode_one_pass.h's lazy max (a row's max and its sums rescale only when a score passes
// it by kMaxSlack), then the probabilities into probs[r * 8 ...] and the row sums. Written
// for R rows at once so that their exps, independent, overlap (a row at a time, through
// memory, they ran one after the other: docs/lab/39-the-avx2-decode-loop.md).
template <int R>
__attribute__((always_inline)) inline void softmax_step8(const __m256 (&s)[R], __m256 valid,
                                                         const SoftmaxRows8& st, float* probs) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  int passes[R], any = 0;  // per row: lanes whose score passes its max by the slack
  for (int r = 0; r < R; ++r) {
    passes[r] = _mm256_movemask_ps(
        _mm256_cmp_ps(s[r], _mm256_set1_ps(st.row_max[r] + kMaxSlack), _CMP_GT_OQ));
    any |= passes[r];
  }
  if (any) {
    for (int r = 0; r < R; ++r) {
      if (!passes[r]) continue;
      float& m = st.row_max[r];
      const float group_max = reduce_max8(s[r]);
      const __m256 cv = _mm256_set1_ps(m == kNegInf ? 0.f : std::exp(m - group_max));
      float* acc = st.acc + r * st.D;
      for (int64_t d = 0; d < st.D; d += 8) {
        _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), cv));
      }
      float* sum = st.row_sum + r * kGroup8;
      _mm256_storeu_ps(sum, _mm256_mul_ps(_mm256_loadu_ps(sum), cv));
      m = group_max;
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 p = _mm256_and_ps(
        valid, at::vec::Vectorized<float>(_mm256_sub_ps(s[r], _mm256_set1_ps(st.row_max[r])))
                   .exp_u20());
    float* sum = st.row_sum + r * kGroup8;
    _mm256_storeu_ps(sum, _mm256_add_ps(_mm256_loadu_ps(sum), p));
    _mm256_storeu_ps(probs + r * kGroup8, p);
  }
}

// Scores of R query rows (row r at q + r * D, float32 in load_chunk's layout) against the
// n <= 8 key rows at keys + t * D, scaled (lanes from n on -inf), and their softmax step
// (softmax_step8): the probabilities into probs[r * 8 ...]. Each key chunk is loaded once for
// all R rows; key rows past n are not read.
template <typename elem_t, int NC, int R>
void group_probs8(const float* q, const elem_t* keys, int64_t n, float scale,
                  const SoftmaxRows8& st, float* probs) {
  constexpr int64_t D = kChunk * NC;
  // K keys at a time: each query vector is loaded once for all K (the loads, not the FMAs,
  // bounded a key at a time: 2 loads a cycle on Zen 1), and R * K sums are in flight, so
  // their FMAs' latency hides behind each other (with 1 or 2 rows and 2 keys it did not).
  // K: 2 for 3 rows (6 sums, a chunk half of 2 keys, a query vector: 9 of 16 registers; 4
  // keys would take 17), 4 for fewer. Each key's partial sums keep one order: chunk by
  // chunk, the first half then the second.
  constexpr int K = R >= 3 ? 2 : 4;
  auto partials = [&](int t, __m256 (&part)[K][R]) {
    const elem_t* key[K];
    for (int k = 0; k < K; ++k) key[k] = keys + std::min<int64_t>(t + k, n - 1) * D;
    // The query rows are the same for every call, and GCC, seeing that, loaded all 2R * NC
    // of their vectors once per group and spilled them to the stack (objdump): 24 stores and
    // reloads a group for nothing. The empty asm makes q opaque to it, so each call loads
    // them from q itself (docs/lab/39-the-avx2-decode-loop.md).
    const float* qt = q;
    asm("" : "+r"(qt));
    for (int c = 0; c < NC; ++c) {
      for (int h = 0; h < 2; ++h) {
        __m256 kv[K];
        for (int k = 0; k < K; ++k) kv[k] = load_half(key[k] + kChunk * c, h);
        for (int r = 0; r < R; ++r) {
          const __m256 qv = _mm256_loadu_ps(qt + r * D + kChunk * c + 8 * h);
          for (int k = 0; k < K; ++k) {
            part[k][r] = c == 0 && h == 0 ? _mm256_mul_ps(qv, kv[k])
                                          : _mm256_fmadd_ps(qv, kv[k], part[k][r]);
          }
        }
      }
    }
  };
  __m256 quad[2][R];
  for (int h = 0; h < 2; ++h) {
    __m256 pair[2][R];
    for (int i = 0; i < 4; i += K) {
      __m256 part[K][R];
      partials(4 * h + i, part);
      for (int k = 0; k < K; k += 2) {
        for (int r = 0; r < R; ++r) pair[(i + k) / 2][r] = fold_keys8(part[k][r], part[k + 1][r]);
      }
    }
    for (int r = 0; r < R; ++r) quad[h][r] = fold_pairs8(pair[0][r], pair[1][r]);
  }
  const __m256 valid = first_lanes(n);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 s[R];
  for (int r = 0; r < R; ++r) {
    const __m256 x = _mm256_mul_ps(fold_halves8(quad[0][r], quad[1][r]), _mm256_set1_ps(scale));
    s[r] = _mm256_blendv_ps(neg_inf, x, valid);
  }
  softmax_step8<R>(s, valid, st, probs);
}

// group_probs8 for `rows` query rows, in passes of kScoreRows8.
template <typename elem_t, int NC, int... R>
void group_probs_rows8(const float* q, const elem_t* keys, int64_t n, float scale,
                       const SoftmaxRows8& st, float* probs, int64_t rows,
                       std::integer_sequence<int, R...>) {
  using Fn = void (*)(const float*, const elem_t*, int64_t, float, const SoftmaxRows8&, float*);
  static constexpr Fn fns[] = {&group_probs8<elem_t, NC, R + 1>...};
  constexpr int64_t D = kChunk * NC;
  for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows8) {
    const int64_t m = std::min<int64_t>(kScoreRows8, rows - r0);
    const SoftmaxRows8 part{st.row_max + r0, st.row_sum + r0 * kGroup8, st.acc + r0 * D, D};
    fns[m - 1](q + r0 * D, keys, n, scale, part, probs + r0 * kGroup8);
  }
}

// acc[r][c .. c + 16 CH - 1] += sum_t probs[r][t] * values[t][c .. c + 16 CH - 1] for R rows,
// CH chunks, and the n value rows at values + t * D (the accumulators in load_chunk's
// layout); with kPrefetch, the next block's rows t into L1 as they go, each chunk the lines
// its own columns start (a block's prefetches spread over the loop, as in decode_one_pass.h).
// Prefetching a row's whole lines in the first chunk alone had GCC store all 2R sums to the
// stack after every value row of that chunk (objdump), which cost the loop its stores
// (docs/lab/38-the-avx2-small-gemms-were-store-bound.md).
template <typename elem_t, int R, int CH, bool kPrefetch>
__attribute__((always_inline)) inline void chunk_values8(
    const float* probs, const elem_t* values, int64_t n, int64_t D, int64_t c, float* acc,
    const elem_t* next_keys, const elem_t* next_values) {
  __m256 a[R][2 * CH];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 2 * CH; ++j) a[r][j] = _mm256_loadu_ps(acc + r * D + c + 8 * j);
  }
  for (int64_t t = 0; t < n; ++t) {
    __m256 v[2 * CH];
    for (int ch = 0; ch < CH; ++ch) {
      const int64_t col = c + kChunk * ch;
      if constexpr (kPrefetch) {
        if (col * static_cast<int64_t>(sizeof(elem_t)) % 64 == 0) {  // the chunk starts a line
          _mm_prefetch(reinterpret_cast<const char*>(next_keys + t * D + col), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(next_values + t * D + col), _MM_HINT_T0);
        }
      }
      load_chunk(values + t * D + col, v[2 * ch], v[2 * ch + 1]);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 p = _mm256_broadcast_ss(probs + r * kGroup8 + t);
      for (int j = 0; j < 2 * CH; ++j) a[r][j] = _mm256_fmadd_ps(p, v[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 2 * CH; ++j) _mm256_storeu_ps(acc + r * D + c + 8 * j, a[r][j]);
  }
}

// Chunks per chunk_values8 pass for R rows: 2 for one or two rows, so that each value row
// feeds 4R FMAs (2R sums, one FMA a row each, sat on their 5-cycle latency); with 3 rows
// and up, 1 (2 chunks would take 4R + 4 + 1 registers of 16).
constexpr int value_chunks_per_pass(int R) { return R <= 2 ? 2 : 1; }

template <typename elem_t, int R, bool kPrefetch>
inline void group_values8_pass(const float* probs, const elem_t* values, int64_t n, int64_t D,
                               float* acc, const elem_t* next_keys, const elem_t* next_values) {
  constexpr int CH = value_chunks_per_pass(R);
  int64_t c = 0;
  for (; c + CH * kChunk <= D; c += CH * kChunk) {
    chunk_values8<elem_t, R, CH, kPrefetch>(probs, values, n, D, c, acc, next_keys,
                                            next_values);
  }
  for (; c < D; c += kChunk) {  // an odd last chunk
    chunk_values8<elem_t, R, 1, kPrefetch>(probs, values, n, D, c, acc, next_keys, next_values);
  }
}

template <typename elem_t, int R>
void group_values8(const float* probs, const elem_t* values, int64_t n, int64_t D, float* acc,
                   const elem_t* next_keys, const elem_t* next_values) {
  if (next_keys != nullptr) {
    group_values8_pass<elem_t, R, true>(probs, values, n, D, acc, next_keys, next_values);
  } else {
    group_values8_pass<elem_t, R, false>(probs, values, n, D, acc, nullptr, nullptr);
  }
}

// group_values8 for `rows` rows, in passes of kValueRows8; the first pass prefetches.
template <typename elem_t, int... R>
void group_values_rows8(const float* probs, const elem_t* values, int64_t n, int64_t D,
                        float* acc, int64_t rows, std::integer_sequence<int, R...>,
                        const elem_t* next_keys, const elem_t* next_values) {
  using Fn = void (*)(const float*, const elem_t*, int64_t, int64_t, float*, const elem_t*,
                      const elem_t*);
  static constexpr Fn fns[] = {&group_values8<elem_t, R + 1>...};
  for (int64_t r0 = 0; r0 < rows; r0 += kValueRows8) {
    const int64_t m = std::min<int64_t>(kValueRows8, rows - r0);
    const bool first = r0 == 0;
    fns[m - 1](probs + r0 * kGroup8, values, n, D, acc + r0 * D, first ? next_keys : nullptr,
               first ? next_values : nullptr);
  }
}

// One row of D accumulators from load_chunk's layout back to column order: float32 rows are in
// order already; per 16 bfloat16 columns, the even columns' vector and the odd columns'
// interleave (unpack per 128 bits: columns 0-3 and 8-11, 4-7 and 12-15; then the halves).
template <typename elem_t>
inline void to_column_order8(float* row, int64_t D) {
  if constexpr (std::is_same_v<elem_t, uint16_t>) {
    for (int64_t c = 0; c < D; c += kChunk) {
      const __m256 even = _mm256_loadu_ps(row + c), odd = _mm256_loadu_ps(row + c + 8);
      const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
      _mm256_storeu_ps(row + c, _mm256_permute2f128_ps(lo, hi, 0x20));
      _mm256_storeu_ps(row + c + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
  }
}

template <typename elem_t, int NC>
void attend_decode8(const DecodeArgs<elem_t>& a, const DecodeArgs<elem_t>* next_item,
                    DecodeScratch& buf) {
  constexpr int64_t D = kChunk * NC;
  const int64_t G = a.rows, BS = a.block_size;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  buf.reserve(G, D);
  float* acc = buf.acc.data();
  float* query = buf.query.data();
  std::fill(acc, acc + G * D, 0.f);
  std::fill(buf.row_max.begin(), buf.row_max.begin() + G, kNegInf);
  std::fill(buf.row_sum.begin(), buf.row_sum.begin() + G * kGroup8, 0.f);
  const SoftmaxRows8 state{buf.row_max.data(), buf.row_sum.data(), acc, D};
  for (int64_t r = 0; r < G; ++r) {  // the query rows in load_chunk's layout
    for (int64_t c = 0; c < D; c += kChunk) {
      __m256 x, y;
      load_chunk(a.q + r * a.q_head_stride + c, x, y);
      _mm256_storeu_ps(query + r * D + c, x);
      _mm256_storeu_ps(query + r * D + c + 8, y);
    }
  }
  const int64_t first_block = a.key_begin / BS, end_block = (a.key_end + BS - 1) / BS;
  const bool l2_ahead = prefetch_block_after_next();
  int64_t block = checked_block(a, first_block);
  for (int64_t b = first_block; b < end_block; ++b) {
    const NextBlock<elem_t> next = look_ahead(a, b, end_block, l2_ahead, next_item);
    const int64_t lo = std::max(a.key_begin, b * BS), hi = std::min(a.key_end, (b + 1) * BS);
    for (int64_t t0 = lo; t0 < hi; t0 += kGroup8) {
      const int64_t n = std::min(kGroup8, hi - t0);
      const int64_t offset = (block * BS + t0 - b * BS) * D;
      group_probs_rows8<elem_t, NC>(query, a.key_head + offset, n, a.scale, state,
                                    buf.probs.data(), G,
                                    std::make_integer_sequence<int, kScoreRows8>{});
      // The next block's rows t0 - lo ... t0 - lo + n - 1 with this group's value rows.
      const int64_t ahead = (t0 - lo) * D;
      group_values_rows8<elem_t>(buf.probs.data(), a.value_head + offset, n, D, acc, G,
                                 std::make_integer_sequence<int, kValueRows8>{},
                                 next.keys != nullptr ? next.keys + ahead : nullptr,
                                 next.values != nullptr ? next.values + ahead : nullptr);
    }
    block = next.id;
  }
  for (int64_t r = 0; r < G; ++r) {
    to_column_order8<elem_t>(acc + r * D, D);
    const float sum = reduce_add8(_mm256_loadu_ps(buf.row_sum.data() + r * kGroup8));
    store_scaled(acc + r * D, 1.f / sum, output_row(a.out + r * a.out_head_stride), D);
  }
}

// Whether attend_single_query takes this head_dim for elements of elem_t.
template <typename elem_t>
inline bool single_query_head_dim_ok(int64_t head_dim) {
  return head_dim % kChunk == 0 && head_dim <= kMaxDecodeDim;
}

template <typename elem_t, int... NC>
void attend_decode8_chunks(const DecodeArgs<elem_t>& a, const DecodeArgs<elem_t>* next_item,
                           DecodeScratch& buf, std::integer_sequence<int, NC...>) {
  using Fn = void (*)(const DecodeArgs<elem_t>&, const DecodeArgs<elem_t>*, DecodeScratch&);
  static constexpr Fn fns[] = {&attend_decode8<elem_t, NC + 1>...};
  TORCH_CHECK(single_query_head_dim_ok<elem_t>(a.head_dim), "attend_single_query: head_dim ",
              a.head_dim, " not taken");
  fns[a.head_dim / kChunk - 1](a, next_item, buf);
}

// One decode of one kv head. next_item: the thread's next decode (its first block is
// prefetched at the end), or null.
template <typename elem_t>
inline void attend_single_query(const DecodeArgs<elem_t>& a, const DecodeArgs<elem_t>* next_item,
                                DecodeScratch& buf) {
  attend_decode8_chunks(a, next_item, buf,
                        std::make_integer_sequence<int, kMaxDecodeDim / kChunk>{});
}

}  // namespace
}  // namespace carpool_cpu
#endif
