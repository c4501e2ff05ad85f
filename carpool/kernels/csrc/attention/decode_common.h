// What the decode loops share whatever the vector width: a decode's arguments, the per-thread
// scratch, the block-id check and the prefetches of the blocks ahead.
//
// A decode is one query position of one request against its keys, for the G query heads
// sharing one kv head; decode_one_pass.h attends it with AVX512 registers (decode_pairs.h for
// bfloat16 rows of 16 values), decode_one_pass_avx2.h with AVX2 ones. Elements are the cache's
// (float, or uint16_t for bfloat16 bits).

#pragma once

#include "attention/block_ops.h"
#include "runtime/prefetch.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace carpool_cpu {
namespace {  // internal linkage, as in block_ops.h

constexpr int64_t kDecodeGroup = 16;  // the most keys of a softmax step (AVX512: 16, AVX2: 8)
constexpr float kMaxSlack = 8.f;  // how far a score may exceed the running max (attend_decode)

// Values of elem_t in one 64-byte cache line.
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

// Per-thread state across a call's items: per row, the value accumulators and the float32
// query (AVX2), and a group's scores, probabilities and sums; and whether AVX-512 loops widen
// bfloat16 rows to float32 (decode_one_pass.h: -1 as this CPU prefers, 0 no, 1 yes).
struct DecodeScratch {
  std::vector<float> acc, query, scores, probs, row_max, row_sum;
  int widen_bf16 = -1;
  void reserve(int64_t rows, int64_t head_dim) {
    if (static_cast<int64_t>(acc.size()) < rows * head_dim) {
      acc.resize(rows * head_dim);
      query.resize(rows * head_dim);
    }
    if (static_cast<int64_t>(row_max.size()) < rows) {
      scores.resize(rows * kDecodeGroup);
      probs.resize(rows * kDecodeGroup);
      row_max.resize(rows);
      row_sum.resize(rows * kDecodeGroup);
    }
  }
};

// Every function here that only prefetches is forced inline, as prefetch_block_l1 is
// (runtime/prefetch.h).

// Whether attend_decode also prefetches the block after next into L2. On AMD's Zen 4 the
// one-block-ahead L1 prefetches alone leave the reads and the arithmetic nearly serial; on
// Intel's Sapphire Rapids L2 prefetches ahead of the L1 ones only cost time
// (docs/lab/28-the-decode-kernel-is-not-at-the.md).
inline bool prefetch_block_after_next() {
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
}

// `bytes` of keys and of values into L2, a line of each in turn.
__attribute__((always_inline)) inline void prefetch_block_l2(const void* keys, const void* values,
                                                             int64_t bytes) {
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
template <typename elem_t>
__attribute__((always_inline)) inline void prefetch_first_block(const DecodeArgs<elem_t>& a) {
  const int64_t D = a.head_dim;
  const int64_t b = a.key_begin / a.block_size, block = a.table[b];
  if (block < 0 || block >= a.num_cache_blocks) return;  // attend_decode raises on it
  const int64_t first = a.key_begin - b * a.block_size;
  const int64_t n = std::min(a.block_size - first, a.key_end - a.key_begin);
  const int64_t offset = (block * a.block_size + first) * D;
  prefetch_block_l1(a.key_head + offset, n * D * sizeof(elem_t));
  prefetch_block_l1(a.value_head + offset, n * D * sizeof(elem_t));
}

// With l2_ahead (prefetch_block_after_next: AMD), block b + 2 of `a` into L2 while block b
// is attended.
template <typename elem_t>
__attribute__((always_inline)) inline void prefetch_far_block_l2(const DecodeArgs<elem_t>& a,
                                                                int64_t b, int64_t end_block,
                                                                bool l2_ahead) {
  if (!l2_ahead || b + 2 >= end_block) return;
  const int64_t far = a.table[b + 2];  // an id outside the cache raises when it is reached
  if (far >= 0 && far < a.num_cache_blocks) {
    const int64_t rows = a.block_size * a.head_dim;
    prefetch_block_l2(a.key_head + far * rows, a.value_head + far * rows, rows * sizeof(elem_t));
  }
}

// Block b + 1 of `a` for the one-pass loops, which prefetch its rows into L1 a few lines at a
// time while block b is attended: its id (-1: b is the last) and its key and value rows.
template <typename elem_t>
struct NextBlock {
  int64_t id = -1;
  const elem_t* keys = nullptr;
  const elem_t* values = nullptr;
};

// Before block b is attended: block b + 1 (checked), block b + 2 into L2 on AMD, and at the
// last block the first block of the thread's next item (if any) into L1.
template <typename elem_t>
__attribute__((always_inline)) inline NextBlock<elem_t> look_ahead(
    const DecodeArgs<elem_t>& a, int64_t b, int64_t end_block, bool l2_ahead,
    const DecodeArgs<elem_t>* next_item) {
  const int64_t rows = a.block_size * a.head_dim;
  NextBlock<elem_t> next;
  if (b + 1 < end_block) {
    next.id = checked_block(a, b + 1);
    next.keys = a.key_head + next.id * rows;
    next.values = a.value_head + next.id * rows;
  } else if (next_item != nullptr) {
    prefetch_first_block(*next_item);
  }
  prefetch_far_block_l2(a, b, end_block, l2_ahead);
  return next;
}

// The output rows' element type for store_scaled.
inline float* output_row(float* p) { return p; }
inline at::BFloat16* output_row(uint16_t* p) { return reinterpret_cast<at::BFloat16*>(p); }

}  // namespace
}  // namespace carpool_cpu
#endif
