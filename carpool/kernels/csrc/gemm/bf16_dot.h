// The AVX512-BF16 inner loop shared by small_gemm.cpp and prefill_attention.cpp: R rows of
// bfloat16 values times B blocks of 16 columns packed as (k, k + 1) pairs, accumulated in
// float32 registers by `vdpbf16ps`. Internal linkage (an anonymous namespace): each file
// that includes it gets its own copy, so two builds loaded in one process never share one.

#pragma once

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define CARPOOL_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace {

constexpr int64_t kBf16Block = 16;  // columns per packed block (one float32 register)

// acc[r][b] += sum over pairs p < `pairs` of a[r][2p..2p+1] . w[b][p]: rows of `a` (bfloat16,
// stride a_stride) times B packed blocks (block stride w_stride, 32 values per pair, pairs
// pair_stride values apart: by default each block's pairs are contiguous).
template <int R, int B>
CARPOOL_BF16_TARGET inline void bf16_dot_tile(const uint16_t* a, int64_t a_stride,
                                              const uint16_t* w, int64_t w_stride, int64_t pairs,
                                              __m512 (&acc)[R][B],
                                              int64_t pair_stride = 2 * kBf16Block) {
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i wv[B];
    for (int b = 0; b < B; ++b) wv[b] = _mm512_loadu_si512(w + b * w_stride + p * pair_stride);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * a_stride + 2 * p, sizeof(pair));
      const __m512i av = _mm512_set1_epi32(pair);
      for (int b = 0; b < B; ++b) {
        acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)wv[b], (__m512bh)av);
      }
    }
  }
}

}  // namespace
#endif
