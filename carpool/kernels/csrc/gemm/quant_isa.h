// The vector registers the quantized GEMM (quant_gemm.cpp) and dequantize_rows
// (quant_pack.cpp) work in: 16 output columns of float32 as one AVX-512 register, two AVX2
// ones, or 16 scalars (DEFAULT builds, no vector code). Internal linkage: each build's copy
// is its own.

#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

// 5 bits (quant_weight.h): where pair j of a unit sits. Pairs 0..14 are field j % 3 (bits 5 f..
// and 16 + 5 f..) of chunk j / 3's dwords; pair 15 is spread over the spare bits 15 and 31 of
// the five chunks' dwords, chunk i holding bit i of its two u.
constexpr int kPairsIn5Fields = 15;
inline int pair5_chunk(int64_t j) { return static_cast<int>(j / 3); }
inline int pair5_shift(int64_t j) { return static_cast<int>(5 * (j % 3)); }

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
  // 6 bits (quant_weight.h): pair p's k (lo) and k + 1 (hi) for the columns [c0, c0 + kLanes)
  static void i8_pair(const uint8_t* q, int64_t p, int64_t c0, F& lo, F& hi) {
    const __m512i d = _mm512_cvtepi8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + p * 32 + c0 * 2)));
    lo = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(d, 16), 16));
    hi = _mm512_cvtepi32_ps(_mm512_srai_epi32(d, 16));
  }
  // 4 and 5 bits (quant_weight.h): pair j (k0 + j, k0 + 16 + j) of a 32-k unit, for the
  // columns [c0, c0 + kLanes): 4 bits, each column's dword of chunk j / 4 shifted to nibble
  // j % 4; 5 bits, u5_dwords' five bits minus 16.
  static __m512i unit_dwords(const uint8_t* unit, int64_t j, int64_t c0) {
    const __m512i d = _mm512_loadu_si512(unit + (j >> 2) * 64 + c0 * 4);
    return _mm512_srl_epi32(d, _mm_cvtsi32_si128(static_cast<int>(4 * (j & 3))));
  }
  static void u4(const uint8_t* unit, int64_t j, int64_t c0, F& lo, F& hi) {
    const __m512i d = unit_dwords(unit, j, c0), fifteen = _mm512_set1_epi32(15);
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(d, fifteen));
    hi = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(d, 16), fifteen));
  }
  // Each column's dword with pair j's two u in bits 0-4 and 16-20 (bits above are other
  // pairs' and are masked off or ignored by the reader).
  static __m512i u5_dwords(const uint8_t* unit, int64_t j, int64_t c0) {
    const auto chunk = [&](int i) { return _mm512_loadu_si512(unit + i * 64 + c0 * 4); };
    if (j < kPairsIn5Fields)
      return _mm512_srl_epi32(chunk(pair5_chunk(j)), _mm_cvtsi32_si128(pair5_shift(j)));
    __m512i d = _mm512_setzero_si512();
    for (int i = 0; i < 5; ++i)  // d |= (chunk i >> (15 - i)) & bit i of each half
      d = _mm512_ternarylogic_epi32(_mm512_srli_epi32(chunk(i), 15 - i),
                                    _mm512_set1_epi32(0x00010001 << i), d, 0xea);
    return d;
  }
  static void u5(const uint8_t* unit, int64_t j, int64_t c0, F& lo, F& hi) {
    const __m512i d = u5_dwords(unit, j, c0), five = _mm512_set1_epi32(31),
                  sixteen = _mm512_set1_epi32(16);
    lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(d, five), sixteen));
    hi = _mm512_cvtepi32_ps(
        _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(d, 16), five), sixteen));
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
  static void i8_pair(const uint8_t* q, int64_t p, int64_t c0, F& lo, F& hi) {
    const __m256i d = _mm256_cvtepi8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + p * 32 + c0 * 2)));
    lo = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(d, 16), 16));
    hi = _mm256_cvtepi32_ps(_mm256_srai_epi32(d, 16));
  }
  static __m256i unit_dwords(const uint8_t* unit, int64_t j, int64_t c0) {
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + (j >> 2) * 64 + c0 * 4));
    return _mm256_srl_epi32(d, _mm_cvtsi32_si128(static_cast<int>(4 * (j & 3))));
  }
  static void u4(const uint8_t* unit, int64_t j, int64_t c0, F& lo, F& hi) {
    const __m256i d = unit_dwords(unit, j, c0), fifteen = _mm256_set1_epi32(15);
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(d, fifteen));
    hi = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(d, 16), fifteen));
  }
  static __m256i u5_dwords(const uint8_t* unit, int64_t j, int64_t c0) {
    const auto chunk = [&](int i) {
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + i * 64 + c0 * 4));
    };
    if (j < kPairsIn5Fields)
      return _mm256_srl_epi32(chunk(pair5_chunk(j)), _mm_cvtsi32_si128(pair5_shift(j)));
    __m256i d = _mm256_setzero_si256();
    for (int i = 0; i < 5; ++i)
      d = _mm256_or_si256(d, _mm256_and_si256(_mm256_srli_epi32(chunk(i), 15 - i),
                                              _mm256_set1_epi32(0x00010001 << i)));
    return d;
  }
  static void u5(const uint8_t* unit, int64_t j, int64_t c0, F& lo, F& hi) {
    const __m256i d = u5_dwords(unit, j, c0), five = _mm256_set1_epi32(31),
                  sixteen = _mm256_set1_epi32(16);
    lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(d, five), sixteen));
    hi = _mm256_cvtepi32_ps(
        _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(d, 16), five), sixteen));
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
  static uint32_t dword(const uint8_t* p) {
    uint32_t d;
    std::memcpy(&d, p, 4);
    return d;
  }
  static void i8_pair(const uint8_t* q, int64_t p, int64_t c0, F& lo, F& hi) {
    lo = static_cast<float>(static_cast<int8_t>(q[p * 32 + c0 * 2]));
    hi = static_cast<float>(static_cast<int8_t>(q[p * 32 + c0 * 2 + 1]));
  }
  static void u4(const uint8_t* unit, int64_t j, int64_t c0, F& lo, F& hi) {
    const uint32_t d = dword(unit + (j >> 2) * 64 + c0 * 4) >> (4 * (j & 3));
    lo = static_cast<float>(d & 15);
    hi = static_cast<float>((d >> 16) & 15);
  }
  static void u5(const uint8_t* unit, int64_t j, int64_t c0, F& lo, F& hi) {
    uint32_t d = 0;
    if (j < kPairsIn5Fields) {
      d = dword(unit + pair5_chunk(j) * 64 + c0 * 4) >> pair5_shift(j);
    } else {
      for (int i = 0; i < 5; ++i)
        d |= (dword(unit + i * 64 + c0 * 4) >> (15 - i)) & (0x00010001u << i);
    }
    lo = static_cast<float>(static_cast<int>(d & 31) - 16);
    hi = static_cast<float>(static_cast<int>((d >> 16) & 31) - 16);
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
