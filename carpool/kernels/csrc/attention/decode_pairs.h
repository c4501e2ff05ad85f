// Decode attention for bfloat16 caches of head_dim 16: two keys to a register.
//
// Why its own loop: a bfloat16 row of 16 values is 32 bytes, half of what decode_one_pass.h
// works in (a cache line per row), and a model this narrow does little arithmetic per key, so
// the cost per key is the loop's vector operations, not the memory: one row per register
// would leave half of every vdpbf16ps and value FMA idle, and fold 16 partial-sum vectors per
// 16 keys per query row. Here rows t and t + 1 of a block (contiguous: 64 bytes) are one
// register, for the keys and for the values:
// - scores: vdpbf16ps of the query row (in both halves of a register) with 8 such key pairs
//   gives 8 vectors, each with key 2j's 8 partial sums below and key 2j + 1's above; two
//   levels of the transpose-add tree and one cross-lane add make them 16 scores, in the
//   lane order kScoreKeys (no third level, no reordering);
// - values: the probabilities of keys 2j and 2j + 1, each over 8 lanes (one permute), times
//   the pair's even columns (a shift) and odd columns (a mask), into accumulators that hold
//   even keys' sums below and odd keys' above; the halves are added and the columns
//   interleaved once per query row at the end.
// The online softmax takes a group of up to 16 keys of one block at once, as in
// decode_one_pass.h; a group's running sum is a vector (one horizontal add per item, not per
// group). Up to kPairRows query rows share each key and value load, their accumulators in
// registers for the whole item. Keys outside [key_begin, key_end) are never read.

#pragma once

#include "attention/decode_one_pass.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(CARPOOL_AVX512_BF16)
namespace carpool_cpu {
namespace {  // internal linkage, as in block_ops.h

constexpr int64_t kPairDim = 16;  // head_dim this loop takes
constexpr int kPairRows = 4;      // query rows per pass over the keys

// The key whose score is in each lane of pair_scores' result.
alignas(64) constexpr int32_t kScoreKeys[16] = {0, 2, 4, 6, 1, 3, 5, 7,
                                                8, 10, 12, 14, 9, 11, 13, 15};

// Rows t and t + 1 of 16 bfloat16 values at rows + t * 16, for t < n; the rows from n on read
// as zeros (and are not read).
__attribute__((always_inline)) inline __m512i load_row_pair(const uint16_t* rows, int64_t t,
                                                            int64_t n) {
  const int64_t valid = std::min<int64_t>(std::max<int64_t>(n - t, 0), 2);
  const __mmask32 mask = valid == 2 ? ~__mmask32{0} : valid == 1 ? __mmask32{0xFFFF} : 0;
  return _mm512_maskz_loadu_epi16(mask, rows + t * kPairDim);
}

// Lane i = key kScoreKeys[i]'s score: the sum of its 8 lanes in part[j] (key 2j in lanes
// 0..7, key 2j + 1 in lanes 8..15), scaled. decode_one_pass.h's tree without its last level:
// after fold_pairs a key's 8 lanes span two 128-bit quarters (0 and 1 for even keys, 2 and 3
// for odd ones), which fold_halves adds.
__attribute__((always_inline)) inline __m512 pair_scores(const __m512 (&part)[8], float scale) {
  const __m512 low = fold_pairs(fold_keys(part[0], part[1]), fold_keys(part[2], part[3]));
  const __m512 high = fold_pairs(fold_keys(part[4], part[5]), fold_keys(part[6], part[7]));
  return _mm512_mul_ps(fold_halves(low, high), _mm512_set1_ps(scale));
}

// R query rows, rows r0 .. r0 + R - 1 of the kv head's G, against all of the item's keys.
template <int R>
void attend_pairs_rows(const DecodeArgs<uint16_t>& a, int64_t r0) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t BS = a.block_size;
  const __m512i score_keys = _mm512_load_si512(kScoreKeys);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512bh q[R];
  __m512 acc_even[R], acc_odd[R], sum[R];
  float row_max[R];
  for (int r = 0; r < R; ++r) {
    const __m256i row = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(a.q + (r0 + r) * a.q_head_stride));
    q[r] = (__m512bh)_mm512_broadcast_i64x4(row);
    acc_even[r] = acc_odd[r] = sum[r] = _mm512_setzero_ps();
    row_max[r] = kNegInf;
  }
  // The lanes of a pair's two probabilities in a row's vector of them (kScoreKeys' order).
  __m512i pair_lanes[8];
  for (int j = 0; j < 8; ++j) {
    const int even = j < 4 ? j : 4 + j, odd = even + 4;
    pair_lanes[j] = _mm512_mask_set1_epi32(_mm512_set1_epi32(even), 0xFF00, odd);
  }
  const int64_t first_block = a.key_begin / BS, end_block = (a.key_end + BS - 1) / BS;
  const bool l2_ahead = prefetch_block_after_next();
  const int64_t block_bytes = BS * kPairDim * sizeof(uint16_t);
  int64_t block = checked_block(a, first_block);
  for (int64_t b = first_block; b < end_block; ++b) {
    int64_t next = -1;
    if (b + 1 < end_block) {  // the next block into L1 while this one is attended
      next = checked_block(a, b + 1);
      prefetch_block_l1(a.key_head + next * BS * kPairDim, block_bytes);
      prefetch_block_l1(a.value_head + next * BS * kPairDim, block_bytes);
    }
    prefetch_far_block_l2(a, b, end_block, l2_ahead);
    const int64_t lo = std::max(a.key_begin, b * BS), hi = std::min(a.key_end, (b + 1) * BS);
    for (int64_t t0 = lo; t0 < hi; t0 += kDecodeGroup) {
      const int64_t n = std::min(kDecodeGroup, hi - t0);
      const int64_t offset = (block * BS + t0 - b * BS) * kPairDim;
      const uint16_t* keys = a.key_head + offset;
      const uint16_t* values = a.value_head + offset;
      const __mmask16 valid = _mm512_cmplt_epi32_mask(score_keys, _mm512_set1_epi32(n));
      __m512i key_pairs[8];
      for (int j = 0; j < 8; ++j) key_pairs[j] = load_row_pair(keys, 2 * j, n);
      __m512 probs[R];
      for (int r = 0; r < R; ++r) {
        __m512 part[8];
        for (int j = 0; j < 8; ++j) {
          part[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[r], (__m512bh)key_pairs[j]);
        }
        const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), valid,
                                            pair_scores(part, a.scale));
        if (passes_running_max(s, row_max[r])) {
          const float group_max = _mm512_reduce_max_ps(s);
          const __m512 c = _mm512_set1_ps(row_max[r] == kNegInf ? 0.f
                                                                : std::exp(row_max[r] - group_max));
          acc_even[r] = _mm512_mul_ps(acc_even[r], c);
          acc_odd[r] = _mm512_mul_ps(acc_odd[r], c);
          sum[r] = _mm512_mul_ps(sum[r], c);
          row_max[r] = group_max;
        }
        probs[r] = _mm512_maskz_mov_ps(valid, at::vec::Vectorized<float>(
            _mm512_sub_ps(s, _mm512_set1_ps(row_max[r]))).exp_u20());
        sum[r] = _mm512_add_ps(sum[r], probs[r]);
      }
      for (int j = 0; 2 * j < n; ++j) {
        const __m512i pairs = load_row_pair(values, 2 * j, n);
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half));
        for (int r = 0; r < R; ++r) {
          const __m512 p = _mm512_permutexvar_ps(pair_lanes[j], probs[r]);
          acc_even[r] = _mm512_fmadd_ps(p, even, acc_even[r]);
          acc_odd[r] = _mm512_fmadd_ps(p, odd, acc_odd[r]);
        }
      }
    }
    block = next;
  }
  // Columns 2i and 2i + 1 from lane i of the even and the odd sums (low half + high half).
  const __m512i interleave = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                              16, 0);
  for (int r = 0; r < R; ++r) {
    const __m512 even = _mm512_add_ps(
        acc_even[r], _mm512_shuffle_f32x4(acc_even[r], acc_even[r], _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512 odd = _mm512_add_ps(
        acc_odd[r], _mm512_shuffle_f32x4(acc_odd[r], acc_odd[r], _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512 out = _mm512_mul_ps(_mm512_permutex2var_ps(even, interleave, odd),
                                     _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum[r])));
    at::vec::convert_from_float<at::BFloat16>(at::vec::Vectorized<float>(out),
                                              at::vec::Vectorized<float>(0.f))
        .store(output_row(a.out + (r0 + r) * a.out_head_stride), kPairDim);
  }
}

template <int... R>
void attend_decode_pairs(const DecodeArgs<uint16_t>& a, std::integer_sequence<int, R...>) {
  using Fn = void (*)(const DecodeArgs<uint16_t>&, int64_t);
  static constexpr Fn fns[] = {&attend_pairs_rows<R + 1>...};
  for (int64_t r0 = 0; r0 < a.rows; r0 += kPairRows) {
    fns[std::min<int64_t>(kPairRows, a.rows - r0) - 1](a, r0);
  }
}

}  // namespace
}  // namespace carpool_cpu
#endif

#if defined(CPU_CAPABILITY_AVX512)
namespace carpool_cpu {
namespace {

// Whether attend_single_query takes this head_dim for elements of elem_t.
template <typename elem_t>
inline bool single_query_head_dim_ok(int64_t head_dim) {
#if defined(CARPOOL_AVX512_BF16)
  if (std::is_same_v<elem_t, uint16_t> && head_dim == kPairDim) return true;
#endif
  return decode_one_pass_head_dim_ok<elem_t>(head_dim);
}

// One decode of one kv head: bfloat16 rows of 16 values by pairs, the rest in one pass.
// next_item: the thread's next decode, or null (the one-pass loop prefetches its first block
// at the end; the pairs loop, for caches this small, does not).
template <typename elem_t>
inline void attend_single_query(const DecodeArgs<elem_t>& a, const DecodeArgs<elem_t>* next_item,
                                DecodeScratch& buf) {
#if defined(CARPOOL_AVX512_BF16)
  if constexpr (std::is_same_v<elem_t, uint16_t>) {
    if (a.head_dim == kPairDim) {
      attend_decode_pairs(a, std::make_integer_sequence<int, kPairRows>{});
      return;
    }
  }
#endif
  attend_decode_one_pass(a, next_item, buf);
}

}  // namespace
}  // namespace carpool_cpu
#endif
