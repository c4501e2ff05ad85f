// quant_gemm.cpp's path for many bfloat16 rows on CPUs with AVX512-BF16: the weight rounded
// to bfloat16 (included inside its anonymous namespace, after quant_bf16_tiles.h).
//
// The pairs path (quant_bf16_tiles.h) keeps q exact and folds each group's partial sums into
// the row sums with its scale: a load, a multiply-add and a store per row and block every
// group, which at decode batches of tens to hundreds of rows leaves it behind the bfloat16
// small GEMM. Here a block group's weight is dequantized once per call, s * q + m rounded to
// bfloat16 (as `dequantize_rows` rounds it for oneDNN above the route's cut), into a buffer
// of pairs, and each row tile sums over the whole of K in registers: the bfloat16 small
// GEMM's arithmetic on a weight read in its quantized bytes. A row's result then differs
// from the exact paths' in the weight's rounding, so the route takes this path only from a
// row count on, and never under batch invariance (`rounded_from` in quant_linear).

#pragma once

#if defined(CPU_CAPABILITY_AVX512)

// Two float32 vectors as 16 dwords of bfloat16 pairs (first in the low half), each rounded to
// nearest even (the weights are finite).
CARPOOL_BF16_TARGET inline __m512i bf16_pairs(F first, F second) {
  const auto round = [](F v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  };
  // (first >> 16) | (second & 0xffff0000)
  return _mm512_ternarylogic_epi32(_mm512_srli_epi32(round(first), 16), round(second),
                                   _mm512_set1_epi32(static_cast<int>(0xffff0000u)), 0xf8);
}

// One block's weight as rounded pairs, group after group, into out ([K / 2][16] dwords), in
// the pair order of the pairs path (so x's pairs are the same).
template <int Bits, bool Mins>
CARPOOL_BF16_TARGET void fill_rounded_pairs(const QuantWeight& w, const uint8_t* block,
                                            uint32_t* out) {
  const int64_t pairs = w.group_size / 2;
  for (int64_t grp = 0; grp < w.groups(); ++grp) {
    const uint8_t* group = block + grp * w.group_bytes();
    if constexpr (kPrefetchStreams<Bits>) prefetch_streams<1>(group, 0, w.group_bytes());
    const uint8_t* q = group + w.header_bytes();
    const F s = header_load(group, 0, w.f16_header);
    const F mn = Mins ? header_load(group, kBlock, w.f16_header) : Isa::zero();
    for (int64_t p = 0; p < pairs; ++p) {
      F first, second;
      if constexpr (Bits == 6) {
        Isa::i8_pair(q, p, 0, first, second);
      } else if constexpr (Bits == 8) {
        first = Isa::i8(q + 2 * p * kBlock);
        second = Isa::i8(q + (2 * p + 1) * kBlock);
      } else if constexpr (Bits == 5) {
        Isa::u5(q + (p / 16) * kUnit5, p % 16, 0, first, second);
      } else {
        Isa::u4(q + (p / 16) * kUnit4, p % 16, 0, first, second);
      }
      _mm512_storeu_si512(out + (grp * pairs + p) * kBlock,
                          bf16_pairs(Isa::fma(first, s, mn), Isa::fma(second, s, mn)));
    }
  }
}

// Rows [r0, r0 + R) times blocks [blk, blk + B) from the blocks' rounded pairs: R x B sums
// over all of K in registers, then the bias.
template <int R, int B>
CARPOOL_BF16_TARGET __attribute__((noinline)) void tile_rounded(const Call& call, int64_t r0,
                                                                 int64_t blk,
                                                                 const uint32_t* buffer) {
  const QuantWeight& w = *call.w;
  const int64_t block_pairs = w.k / 2, y_stride = w.blocks() * kBlock;
  const uint16_t* x = call.xb + r0 * call.xb_stride;
  F acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = Isa::zero();
  for (int64_t p = 0; p < block_pairs; ++p) {
    __m512i wv[B];
    for (int b = 0; b < B; ++b)
      wv[b] = _mm512_loadu_si512(buffer + (b * block_pairs + p) * kBlock);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * call.xb_stride + 2 * p, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)wv[b], xv);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < B; ++b) {
      F sum = acc[r][b];
      if (call.bias != nullptr) sum = _mm512_add_ps(sum, Isa::load(call.bias + (blk + b) * kBlock));
      Isa::store(call.y + (r0 + r) * y_stride + (blk + b) * kBlock, sum);
    }
  }
}

template <int MaxR, int MaxB>
void run_tile_rounded(const Call& call, int64_t rows, int64_t nb, int64_t r0, int64_t blk,
                      const uint32_t* buffer) {
  if constexpr (MaxB > 1) {
    if (nb < MaxB) return run_tile_rounded<MaxR, MaxB - 1>(call, rows, nb, r0, blk, buffer);
  }
  if constexpr (MaxR > 1) {
    if (rows < MaxR) return run_tile_rounded<MaxR - 1, MaxB>(call, rows, nb, r0, blk, buffer);
  }
  tile_rounded<MaxR, MaxB>(call, r0, blk, buffer);
}

// Threads split the column blocks (for_each_column_unit, all rows a unit); each fills a unit's
// pairs once for the whole call and runs every row tile over them (6 rows x 4 blocks, as the
// pairs path's wide tile).
template <int Bits, bool Mins>
void run_call_rounded(const Call& call, int64_t m) {
  const QuantWeight& w = *call.w;
  using Shape = WideRows;
  for_each_column_unit(w.blocks(), Shape::kBlocks, m, m, [&] {
    std::vector<uint32_t> buffer(Shape::kBlocks * w.k / 2 * kBlock);
    return [&, buffer = std::move(buffer)](const ColumnUnit& u) mutable {
      for (int64_t b = 0; b < u.nb; ++b)
        fill_rounded_pairs<Bits, Mins>(
            w, w.data.const_data_ptr<uint8_t>() + (u.blk + b) * w.block_bytes(),
            buffer.data() + b * (w.k / 2) * kBlock);
      for_each_row_tile(u.rows, Shape::kRows, [&](int64_t r0, int64_t rows) {
        run_tile_rounded<Shape::kRows, Shape::kBlocks>(call, rows, u.nb, u.r0 + r0, u.blk,
                                                       buffer.data());
      });
    };
  });
}

#else
template <int Bits, bool Mins>
void run_call_rounded(const Call&, int64_t) {}
#endif
