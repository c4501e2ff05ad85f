// quant_gemm.cpp's path for bfloat16 rows on CPUs with AVX512-BF16 (included inside its
// anonymous namespace, after Call, fold_group and store_rows).
//
// q is a small integer (-128..127, or 0..15), exact in bfloat16, and so are bfloat16 rows of
// x: one `vdpbf16ps` then multiplies 16 columns x 2 k of q by a broadcast pair of x, products
// exact, sums in float32, twice the multiply-adds of an FMA a cycle. A pair of q for 16
// columns is built from two widened float32 vectors by keeping their high halves (exact for
// these integers). Pairs are (k, k + 1) for 8 bits; for 4 bits the two nibbles of one byte,
// (k0 + j, k0 + 16 + j), with x copied once per call into that pair order.
//
// Up to FewPairRows::kRows rows build the pairs in registers as the weight streams past; more
// rows build a block group's pairs once into a buffer (L2-resident: 64 bytes a pair of k for the
// group's blocks) that every row tile then reads, in tiles of up to 6 rows x 4 blocks (the
// bfloat16 small GEMM's wide tile). The pairs and the order of the sums are the same either
// way, so a row's result is the same bits in any batch. Each group's partial sums are folded
// as on the float32 path, into row sums kept in y.

#pragma once

#if defined(CPU_CAPABILITY_AVX512)
#include "gemm/bf16_dot.h"

// Pair j of a 4- or 5-bit unit (quant_weight.h) as the indices `vpermw` reads (5 bits a
// word): 4 bits, each column's dword shifted right by 4 (j % 4) holds the pair's nibbles in
// bits 0-3 and 16-19 (bit 4 is the next nibble's, so the 4-bit table holds 0..15 twice); 5
// bits, pairs 0..14 are whole five-bit fields of a chunk's dwords, one shift (Isa::u5_dwords
// gathers pair 15), into a table of -16..15. Inlined with a constant j, the shift is an
// immediate: one shift and one lookup a pair.
template <int Bits>
CARPOOL_BF16_TARGET inline __m512i unit_pairs(const uint8_t* unit, int j) {
  if constexpr (Bits == 5) {
    // bfloat16 of -16..15, indexed by u = q + 16
    const __m512i table = _mm512_set_epi16(
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
        0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000,
        0xbf80, 0xc000, 0xc040, 0xc080, 0xc0a0, 0xc0c0, 0xc0e0, 0xc100,
        0xc110, 0xc120, 0xc130, 0xc140, 0xc150, 0xc160, 0xc170, 0xc180);
    const __m512i index =
        j < kPairsIn5Fields
            ? _mm512_srli_epi32(_mm512_loadu_si512(unit + pair5_chunk(j) * 64), pair5_shift(j))
            : Isa::u5_dwords(unit, j, 0);
    return _mm512_permutexvar_epi16(index, table);
  } else {
    const __m512i d = _mm512_srli_epi32(_mm512_loadu_si512(unit + (j >> 2) * 64), 4 * (j & 3));
    // bfloat16 of 0..15, twice
    const __m512i table = _mm512_set_epi16(
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0,
        0x4080, 0x4040, 0x4000, 0x3f80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
        0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
    return _mm512_permutexvar_epi16(d, table);
  }
}

// Pair p of a group's q (p < g / 2) for 16 columns: one dword a column, the first element's
// bfloat16 in its low half. 8 bits: two widened float32 vectors, their high halves kept
// (exact for these integers); 6 bits: the pair's bytes widened to words, their low six bits
// indexing a table of -32..31 (q mod 64); 4 and 5 bits: unit_pairs, no conversions.
template <int Bits>
CARPOOL_BF16_TARGET inline __m512i q_pairs(const uint8_t* q, int64_t p) {
  if constexpr (Bits == 6) {
    // bfloat16 of 0..31, then of -32..-1
    const __m512i low = _mm512_set_epi16(
        0x41f8, 0x41f0, 0x41e8, 0x41e0, 0x41d8, 0x41d0, 0x41c8, 0x41c0,
        0x41b8, 0x41b0, 0x41a8, 0x41a0, 0x4198, 0x4190, 0x4188, 0x4180,
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
        0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
    const __m512i high = _mm512_set_epi16(
        0xbf80, 0xc000, 0xc040, 0xc080, 0xc0a0, 0xc0c0, 0xc0e0, 0xc100,
        0xc110, 0xc120, 0xc130, 0xc140, 0xc150, 0xc160, 0xc170, 0xc180,
        0xc188, 0xc190, 0xc198, 0xc1a0, 0xc1a8, 0xc1b0, 0xc1b8, 0xc1c0,
        0xc1c8, 0xc1d0, 0xc1d8, 0xc1e0, 0xc1e8, 0xc1f0, 0xc1f8, 0xc200);
    const __m512i words =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + p * 32)));
    return _mm512_permutex2var_epi16(low, words, high);
  } else if constexpr (Bits == 8) {
    const __m512 first = Isa::i8(q + 2 * p * kBlock), second = Isa::i8(q + (2 * p + 1) * kBlock);
    // (first >> 16) | (second & 0xffff0000)
    return _mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_castps_si512(first), 16),
                                     _mm512_castps_si512(second),
                                     _mm512_set1_epi32(static_cast<int>(0xffff0000u)), 0xf8);
  } else {
    return unit_pairs<Bits>(q + (p / 16) * (Bits == 5 ? kUnit5 : kUnit4), p % 16);
  }
}

// One block's pairs, group after group, into out ([K / 2][16] dwords).
template <int Bits>
CARPOOL_BF16_TARGET void fill_pairs(const QuantWeight& w, const uint8_t* block, uint32_t* out) {
  const int64_t pairs = w.group_size / 2;
  for (int64_t grp = 0; grp < w.groups(); ++grp) {
    const uint8_t* group = block + grp * w.group_bytes();
    if constexpr (kPrefetchStreams<Bits>) prefetch_streams<1>(group, 0, w.group_bytes());
    const uint8_t* q = group + w.header_bytes();
    for (int64_t p = 0; p < pairs; ++p)
      _mm512_storeu_si512(out + (grp * pairs + p) * kBlock, q_pairs<Bits>(q, p));
  }
}

// One pair of k: its weights for B blocks (wv) times each row's x pair (at x, rows x_stride
// apart) into the partial sums.
template <int R, int B>
CARPOOL_BF16_TARGET __attribute__((always_inline)) inline void pair_step(
    const uint16_t* x, int64_t x_stride, const __m512i (&wv)[B], F (&part)[R][B]) {
  for (int r = 0; r < R; ++r) {
    int32_t pair;
    std::memcpy(&pair, x + r * x_stride, 4);
    const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
    for (int b = 0; b < B; ++b) part[r][b] = _mm512_dpbf16_ps(part[r][b], (__m512bh)wv[b], xv);
  }
}

// tile() on pairs: rows [r0, r0 + R) times blocks [blk, blk + B); `buffer` holds the blocks'
// pairs (fill_pairs, K / 2 x 16 dwords a block) or is null (built from the weight here).
template <int R, int B, int Bits, bool Mins>
CARPOOL_BF16_TARGET __attribute__((noinline)) void tile_bf16(const Call& call, int64_t r0,
                                                              int64_t blk,
                                                              const uint32_t* buffer) {
  const QuantWeight& w = *call.w;
  const int64_t g = w.group_size, pairs = g / 2, groups = w.groups(), group_bytes = w.group_bytes(),
                block_bytes = w.block_bytes(), header = w.header_bytes(), block_pairs = w.k / 2;
  const uint8_t* base = w.data.const_data_ptr<uint8_t>() + blk * block_bytes;
  const uint16_t* x = call.xb + r0 * call.xb_stride;
  // The row sums live in y (in L1 while the tile runs), read and written once a group, so
  // that the registers hold a wide tile's partial sums.
  float* y = call.y + r0 * (w.blocks() * kBlock) + blk * kBlock;
  const int64_t y_stride = w.blocks() * kBlock;
  for (int b = 0; b < B; ++b) {
    const F init = call.bias == nullptr ? Isa::zero() : Isa::load(call.bias + (blk + b) * kBlock);
    for (int r = 0; r < R; ++r) Isa::store(y + r * y_stride + b * kBlock, init);
  }
  for (int64_t grp = 0; grp < groups; ++grp) {
    const uint8_t* group = base + grp * group_bytes;
    if (kPrefetchStreams<Bits> && buffer == nullptr)
      prefetch_streams<B>(group, block_bytes, group_bytes);
    F part[R][B];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) part[r][b] = Isa::zero();
    if ((Bits == 4 || Bits == 5) && buffer == nullptr) {
      // a unit's 16 pairs unrolled, so that each pair's shifts are immediates
      constexpr int64_t unit_bytes = Bits == 5 ? kUnit5 : kUnit4;
      for (int64_t u = 0; u < pairs / 16; ++u) {
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          __m512i wv[B];
          for (int b = 0; b < B; ++b)
            wv[b] = unit_pairs<Bits>(group + b * block_bytes + header + u * unit_bytes, j);
          pair_step<R, B>(x + grp * g + 2 * (u * 16 + j), call.xb_stride, wv, part);
        }
      }
    } else {
      for (int64_t p = 0; p < pairs; ++p) {
        __m512i wv[B];
        for (int b = 0; b < B; ++b) {
          wv[b] = buffer != nullptr
                      ? _mm512_loadu_si512(buffer + (b * block_pairs + grp * pairs + p) * kBlock)
                      : q_pairs<Bits>(group + b * block_bytes + header, p);
        }
        pair_step<R, B>(x + grp * g + 2 * p, call.xb_stride, wv, part);
      }
    }
    for (int b = 0; b < B; ++b) {
      const uint8_t* scales = group + b * block_bytes;
      const F s = header_load(scales, 0, w.f16_header);
      const F mn = Mins ? header_load(scales, kBlock, w.f16_header) : Isa::zero();
      for (int r = 0; r < R; ++r) {
        float* out = y + r * y_stride + b * kBlock;
        F sum = Isa::fma(part[r][b], s, Isa::load(out));
        if constexpr (Mins) sum = Isa::fma(Isa::bcast(call.xsum + (r0 + r) * groups + grp), mn, sum);
        Isa::store(out, sum);
      }
    }
  }
}

template <int MaxR, int MaxB, int Bits, bool Mins>
void run_tile_bf16(const Call& call, int64_t rows, int64_t nb, int64_t r0, int64_t blk,
                   const uint32_t* buffer) {
  if constexpr (MaxB > 1) {
    if (nb < MaxB) return run_tile_bf16<MaxR, MaxB - 1, Bits, Mins>(call, rows, nb, r0, blk, buffer);
  }
  if constexpr (MaxR > 1) {
    if (rows < MaxR) return run_tile_bf16<MaxR - 1, MaxB, Bits, Mins>(call, rows, nb, r0, blk, buffer);
  }
  tile_bf16<MaxR, MaxB, Bits, Mins>(call, r0, blk, buffer);
}

// Tiles of the pairs path: up to 2 rows x 8 blocks (8 chains of sums a row), and for more
// rows 6 x 4 (24 partial sums). The row sums are in y, not in registers.
struct FewPairRows { static constexpr int kRows = 2, kBlocks = 8; };
struct WideRows { static constexpr int kRows = 6, kBlocks = 4; };

// run_call's split of rows and columns, on pairs (for_each_column_unit); buffered above
// FewPairRows::kRows rows.
template <typename Shape, int Bits, bool Mins>
void run_call_bf16(const Call& call, int64_t m) {
  const QuantWeight& w = *call.w;
  const bool buffered = m > FewPairRows::kRows;
  for_each_column_unit(w.blocks(), Shape::kBlocks, m, kRowBlock, [&] {
    std::vector<uint32_t> buffer(buffered ? Shape::kBlocks * w.k / 2 * kBlock : 0);
    return [&, buffer = std::move(buffer)](const ColumnUnit& u) mutable {
      if (buffered) {
        for (int64_t b = 0; b < u.nb; ++b)
          fill_pairs<Bits>(w, w.data.const_data_ptr<uint8_t>() + (u.blk + b) * w.block_bytes(),
                           buffer.data() + b * (w.k / 2) * kBlock);
      }
      for_each_row_tile(u.rows, Shape::kRows, [&](int64_t r0, int64_t rows) {
        run_tile_bf16<Shape::kRows, Shape::kBlocks, Bits, Mins>(
            call, rows, u.nb, u.r0 + r0, u.blk, buffered ? buffer.data() : nullptr);
      });
    };
  });
}

// Whether this call takes the pairs path: bfloat16 rows, whole pairs in a group, a CPU with
// AVX512-BF16.
inline bool takes_bf16_pairs(const at::Tensor& x, const QuantWeight& w) {
  return x.scalar_type() == at::kBFloat16 && w.group_size % 2 == 0 &&
         __builtin_cpu_supports("avx512bf16");
}

template <int Bits, bool Mins>
void run_call_bf16(const Call& call, int64_t m) {
  if (m <= FewPairRows::kRows) {
    run_call_bf16<FewPairRows, Bits, Mins>(call, m);
  } else {
    run_call_bf16<WideRows, Bits, Mins>(call, m);
  }
}

#else
inline bool takes_bf16_pairs(const at::Tensor&, const QuantWeight&) { return false; }
template <int Bits, bool Mins>
void run_call_bf16(const Call&, int64_t) {}
#endif
