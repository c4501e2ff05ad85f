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

// A 5-bit unit's flip mask of pair j (quant_weight.h), from column c0's bits on.
inline uint32_t flip_mask(const uint8_t* unit, int64_t j, int64_t c0) {
  uint32_t m;
  std::memcpy(&m, unit + 256 + j * 4, 4);
  return m >> (2 * c0);
}

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
  // 4 and 5 bits (quant_weight.h): pair j (k0 + j, k0 + 16 + j) of a 32-k unit, for the
  // columns [c0, c0 + kLanes): each column's dword of chunk j / 4, shifted to nibble j % 4;
  // 5 bits take five bits there, bit 4 flipped where the pair's flip mask says, minus 16.
  static __m512i unit_dwords(const uint8_t* unit, int64_t j, int64_t c0) {
    const __m512i d = _mm512_loadu_si512(unit + (j >> 2) * 64 + c0 * 4);
    return _mm512_srl_epi32(d, _mm_cvtsi32_si128(static_cast<int>(4 * (j & 3))));
  }
  static void u4(const uint8_t* unit, int64_t j, int64_t c0, F& lo, F& hi) {
    const __m512i d = unit_dwords(unit, j, c0), fifteen = _mm512_set1_epi32(15);
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(d, fifteen));
    hi = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(d, 16), fifteen));
  }
  static void u5(const uint8_t* unit, int64_t j, int64_t c0, F& lo, F& hi) {
    const __m512i d = unit_dwords(unit, j, c0), five = _mm512_set1_epi32(31),
                  sixteen = _mm512_set1_epi32(16);
    // column c's two flip bits (bits 2c, 2c + 1 of the pair's mask) in bits 0 and 1
    const __m512i flips = _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(flip_mask(unit, j, c0))),
                                            _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16,
                                                              18, 20, 22, 24, 26, 28, 30));
    const __m512i l = _mm512_xor_si512(_mm512_and_si512(d, five),
                                       _mm512_and_si512(_mm512_slli_epi32(flips, 4), sixteen));
    const __m512i h = _mm512_xor_si512(_mm512_and_si512(_mm512_srli_epi32(d, 16), five),
                                       _mm512_and_si512(_mm512_slli_epi32(flips, 3), sixteen));
    lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(l, sixteen));
    hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(h, sixteen));
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
  static __m256i unit_dwords(const uint8_t* unit, int64_t j, int64_t c0) {
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + (j >> 2) * 64 + c0 * 4));
    return _mm256_srl_epi32(d, _mm_cvtsi32_si128(static_cast<int>(4 * (j & 3))));
  }
  static void u4(const uint8_t* unit, int64_t j, int64_t c0, F& lo, F& hi) {
    const __m256i d = unit_dwords(unit, j, c0), fifteen = _mm256_set1_epi32(15);
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(d, fifteen));
    hi = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(d, 16), fifteen));
  }
  static void u5(const uint8_t* unit, int64_t j, int64_t c0, F& lo, F& hi) {
    const __m256i d = unit_dwords(unit, j, c0), five = _mm256_set1_epi32(31),
                  sixteen = _mm256_set1_epi32(16);
    const __m256i flips = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(flip_mask(unit, j, c0))),
                                            _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    const __m256i l = _mm256_xor_si256(_mm256_and_si256(d, five),
                                       _mm256_and_si256(_mm256_slli_epi32(flips, 4), sixteen));
    const __m256i h = _mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi32(d, 16), five),
                                       _mm256_and_si256(_mm256_slli_epi32(flips, 3), sixteen));
    lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(l, sixteen));
    hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(h, sixteen));
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
  static void u4(const uint8_t* unit, int64_t j, int64_t c0, F& lo, F& hi) {
    const uint32_t d = dword(unit + (j >> 2) * 64 + c0 * 4) >> (4 * (j & 3));
    lo = static_cast<float>(d & 15);
    hi = static_cast<float>((d >> 16) & 15);
  }
  static void u5(const uint8_t* unit, int64_t j, int64_t c0, F& lo, F& hi) {
    const uint32_t d = dword(unit + (j >> 2) * 64 + c0 * 4) >> (4 * (j & 3));
    const uint32_t flips = flip_mask(unit, j, c0);
    lo = static_cast<float>(static_cast<int>((d & 31) ^ ((flips & 1) << 4)) - 16);
    hi = static_cast<float>(static_cast<int>(((d >> 16) & 31) ^ ((flips & 2) << 3)) - 16);
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
