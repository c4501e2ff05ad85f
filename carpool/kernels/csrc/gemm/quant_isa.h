// The vector registers the quantized GEMM (quant_gemm.cpp) and dequantize_rows
// (quant_pack.cpp) work in: 16 output columns of float32 as one AVX-512 register, two AVX2
// ones, or 16 scalars (DEFAULT builds, no vector code). Internal linkage: each build's copy
// is its own.

#pragma once

#include <c10/util/Half.h>

#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

#if defined(CPU_CAPABILITY_AVX512)
struct Isa {
  static constexpr int kLanes = 16;
  using F = __m512;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F bcast(const float* p) { return _mm512_set1_ps(*p); }
  static F load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F i8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void u4(const uint8_t* p, F& lo, F& hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
  // 5 bits (quant_weight.h): u4's nibbles, bit 4 from the masks (bit i: lane i), minus 16.
  static void u5(const uint8_t* p, uint32_t mlo, uint32_t mhi, F& lo, F& hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i sixteen = _mm512_set1_epi32(16);
    __m512i l = _mm512_sub_epi32(_mm512_and_si512(v, _mm512_set1_epi32(15)), sixteen);
    __m512i h = _mm512_sub_epi32(_mm512_srli_epi32(v, 4), sixteen);
    l = _mm512_mask_add_epi32(l, static_cast<__mmask16>(mlo), l, sixteen);
    h = _mm512_mask_add_epi32(h, static_cast<__mmask16>(mhi), h, sixteen);
    lo = _mm512_cvtepi32_ps(l);
    hi = _mm512_cvtepi32_ps(h);
  }
};
#elif defined(CPU_CAPABILITY_AVX2)
struct Isa {
  static constexpr int kLanes = 8;
  using F = __m256;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static F load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F i8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void u4(const uint8_t* p, F& lo, F& hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
  static void u5(const uint8_t* p, uint32_t mlo, uint32_t mhi, F& lo, F& hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i sixteen = _mm256_set1_epi32(16);
    // 16 where the lane's mask bit is set, else 0; then minus 16
    const auto high = [&](uint32_t mask) {
      const __m256i bit = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(mask)), lanes);
      return _mm256_sub_epi32(_mm256_and_si256(_mm256_cmpeq_epi32(bit, lanes), sixteen), sixteen);
    };
    lo = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_and_si256(v, _mm256_set1_epi32(15)), high(mlo)));
    hi = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_srli_epi32(v, 4), high(mhi)));
  }
};
#else
struct Isa {
  static constexpr int kLanes = 1;
  using F = float;
  static F zero() { return 0.0f; }
  static F load(const float* p) { return *p; }
  static F bcast(const float* p) { return *p; }
  static F load_f16(const uint16_t* p) { return c10::detail::fp16_ieee_to_fp32_value(*p); }
  static F fma(F a, F b, F c) { return __builtin_fmaf(a, b, c); }
  static void store(float* p, F v) { *p = v; }
  static F i8(const uint8_t* p) { return static_cast<float>(static_cast<int8_t>(*p)); }
  static void u4(const uint8_t* p, F& lo, F& hi) {
    lo = static_cast<float>(*p & 15);
    hi = static_cast<float>(*p >> 4);
  }
  static void u5(const uint8_t* p, uint32_t mlo, uint32_t mhi, F& lo, F& hi) {
    lo = static_cast<float>(static_cast<int>((*p & 15) | ((mlo & 1) << 4)) - 16);
    hi = static_cast<float>(static_cast<int>((*p >> 4) | ((mhi & 1) << 4)) - 16);
  }
};
#endif

// Element i of a group header (scales 0..15, mins 16..31) and the lanes after it, as float32:
// the header is float32, or float16 where the weight was packed with f16_header.
inline Isa::F header_load(const uint8_t* head, int64_t i, bool f16) {
  return f16 ? Isa::load_f16(reinterpret_cast<const uint16_t*>(head) + i)
             : Isa::load(reinterpret_cast<const float*>(head) + i);
}

}  // namespace
