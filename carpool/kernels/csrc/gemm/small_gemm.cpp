// bfloat16 linear layers for a few rows: y = x @ w.T (+ bias), streaming the weight once.
//
// At decode sizes (1 to a few dozen rows) a linear layer is a pass over its weight, and
// oneDNN's bfloat16 matmul streamed the 135M model's weights at well under the memory
// bandwidth this machine has (about half of it for one row, by a microbenchmark of the 120
// layers). Here the weight is repacked once (`pack_bf16_weight`) into blocks of 16 output
// columns whose rows hold (k, k + 1) pairs: [ceil(N / 16)][K / 2][16][2]. One AVX512-BF16
// `vdpbf16ps` then multiplies a 16-column register of weight pairs by a broadcast pair of
// one input row and accumulates in float32; a tile of rows x blocks (12 x 2 up to 12 rows,
// else 6 x 4) keeps its accumulators in registers while the weight streams past. The result
// is rounded to bfloat16 once (after the bias), as oneDNN does.
//
// A row's sums run over k in the same order whatever the number of rows or the tile it
// falls in, and threads split the columns only: a row's result does not depend on its batch.
//
// float32 weights get the same treatment (`pack_f32_weight`, `small_gemm_f32`): blocks of 16
// output columns, [ceil(N / 16)][K][16], one `vfmadd231ps` per (row, block, k) on a broadcast
// input value, the sums in k order, rounded once. Plain AVX-512F: every AVX512 build runs it.
//
// With amx=True (builds for CPUs with AMX, -DCARPOOL_AMX; K a multiple of 32) the same packed
// weight feeds the AMX tile unit instead: its blocks of (k, k + 1) pairs are exactly the
// unit's B tiles. Threads split the columns there too, a fast thread taking a slow one's.
//
// AVX512 builds need AVX512-BF16 at run time for the bfloat16 one (`has_bf16_gemm()`; the
// functions carry it as a target attribute, so the rest of the extension still runs on AVX512
// CPUs without it); elsewhere the callers keep oneDNN. AVX2 builds run both from the same
// packed weights in float32 FMAs (`has_small_gemm_bf16()`): there oneDNN has no bfloat16
// matmul and multiplies a float32 copy, so reading the bfloat16 weight itself halves the bytes
// a few-row call streams.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "gemm/amx_tiles.h"
#include "gemm/bf16_dot.h"
#include "gemm/stealable_shares.h"
#include "gemm/tile_dispatch.h"

namespace carpool_gemm {

namespace {

constexpr int64_t kBlock = 16;  // output columns per register
// Tile shapes, rows x blocks of 16 columns: 24 accumulators either way. The wide one takes 6
// broadcasts of x and 4 weight loads a k step, and wins on Zen 4 (where the broadcasts compete
// with `vdpbf16ps` for its units) from 13 rows on. Up to 12 rows the narrow one is a single
// pass over the weight with half the loads a step (docs/lab/30-the-small-gemms-prefetch-their-next-weight.md).
struct NarrowTile { static constexpr int kRows = 12, kBlocks = 2; };
struct WideTile { static constexpr int kRows = 6, kBlocks = 4; };
constexpr int64_t kChunk = 8;   // k steps between a tile's prefetches of the next weight
// Below this many rows the product is a plain stream over the weight, which the hardware
// prefetcher keeps up with; prefetching ahead as well only slows it (docs/lab/30-the-small-gemms-prefetch-their-next-weight.md).
constexpr int64_t kMinPrefetchRows = 3;

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// The cache lines of the next column group's weight that one tile prefetches into L2 as it
// runs: a thread's groups then find their weight in L2 instead of waiting on memory in
// their first row tile (the weight streams from memory once a step; see for_each_tile).
struct NextWeight {
  const char* lines = nullptr;
  int64_t count = 0;

  // Issues the next `per_chunk` lines (fewer at the end): before each of a tile's chunks,
  // per_chunk = ceil(count / chunks), so they spread over the tile.
  inline void issue(int64_t per_chunk) {
    const int64_t n = std::min(count, per_chunk);
    for (int64_t i = 0; i < n; ++i) _mm_prefetch(lines + i * 64, _MM_HINT_T1);
    lines += n * 64;
    count -= n;
  }
};

#endif

#if defined(CPU_CAPABILITY_AVX512)
// Rows [0, R) of x times blocks [0, B) starting at `w` (block stride `block_stride`), into
// y columns [col0, col0 + B * 16) clipped at n.
// Never inlined: inlined into the dispatch, one shape (7 x 2) once lost its registers and
// ran at half speed; a call per tile costs nothing next to its k loop.
template <int R, int B>
CARPOOL_BF16_TARGET __attribute__((noinline)) void tile(
    const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t pairs, int64_t block_stride,
    const float* bias, uint16_t* y, int64_t y_stride, int64_t col0, int64_t n, NextWeight next) {
  __m512 acc[R][B];
  for (int b = 0; b < B; ++b) {
    const __m512 init = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias + b * kBlock);
    for (int r = 0; r < R; ++r) acc[r][b] = init;
  }
  // In chunks when there is something to prefetch between them (the same k order as one pass)
  const int64_t chunks = next.count == 0 ? 1 : (pairs + kChunk - 1) / kChunk;
  const int64_t chunk = next.count == 0 ? pairs : kChunk;
  const int64_t per_chunk = (next.count + chunks - 1) / chunks;
  for (int64_t c = 0; c < chunks; ++c) {
    next.issue(per_chunk);
    const int64_t p0 = c * chunk;
    bf16_dot_tile<R, B>(x + 2 * p0, x_stride, w + p0 * 2 * kBlock, block_stride,
                        std::min(chunk, pairs - p0), acc);
  }
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < B; ++b) {
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(acc[r][b]);
      const int64_t col = col0 + b * kBlock;
      uint16_t* dst = y + r * y_stride + col;
      if (col + kBlock <= n) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), out);
      } else if (col < n) {
        alignas(32) uint16_t tail[kBlock];
        _mm256_store_si256(reinterpret_cast<__m256i*>(tail), out);
        std::memcpy(dst, tail, (n - col) * sizeof(uint16_t));
      }
    }
  }
}

// The float32 tile: rows [0, R) of x times blocks [0, B) of a [blocks][K][16] weight.
template <int R, int B>
__attribute__((noinline)) void tile_f32(const float* x, int64_t x_stride, const float* w,
                                        int64_t k, int64_t block_stride, const float* bias,
                                        float* y, int64_t y_stride, int64_t col0, int64_t n,
                                        NextWeight next) {
  __m512 acc[R][B];
  for (int b = 0; b < B; ++b) {
    const __m512 init = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias + b * kBlock);
    for (int r = 0; r < R; ++r) acc[r][b] = init;
  }
  const int64_t chunks = next.count == 0 ? 1 : (k + kChunk - 1) / kChunk;
  const int64_t chunk = next.count == 0 ? k : kChunk;
  const int64_t per_chunk = (next.count + chunks - 1) / chunks;
  for (int64_t c = 0; c < chunks; ++c) {
    next.issue(per_chunk);
    for (int64_t p = c * chunk, stop = std::min(k, p + chunk); p < stop; ++p) {
      __m512 wv[B];
      for (int b = 0; b < B; ++b) wv[b] = _mm512_loadu_ps(w + b * block_stride + p * kBlock);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * x_stride + p]);
        for (int b = 0; b < B; ++b) acc[r][b] = _mm512_fmadd_ps(xv, wv[b], acc[r][b]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < B; ++b) {
      const int64_t col = col0 + b * kBlock;
      float* dst = y + r * y_stride + col;
      if (col + kBlock <= n) {
        _mm512_storeu_ps(dst, acc[r][b]);
      } else if (col < n) {
        _mm512_mask_storeu_ps(dst, static_cast<__mmask16>((1u << (n - col)) - 1), acc[r][b]);
      }
    }
  }
}

#endif

#if defined(CPU_CAPABILITY_AVX2)
// AVX2 (no vdpbf16ps, 16 vector registers): the same packed layouts, each 16-column block as
// two 8-float halves, the products in float32 FMAs. A bfloat16 pair register (8 columns of
// (k, k + 1)) widens by a shift (k) and a mask (k + 1), and the two products are summed in
// that order; x's rows come as float32 (widened once per call), broadcast from memory. A
// float32 tile of R rows x one block keeps 2R sums, the weight's two halves and a broadcast
// (6 rows); a bfloat16 one also keeps both halves' widened pairs and the mask, and takes 5
// rows (a k step widens the block once, then runs row by row).
struct Avx2Tile { static constexpr int kRows = 6, kBlocks = 1; };
struct Avx2Bf16Tile { static constexpr int kRows = 5, kBlocks = 1; };

// An AVX2 tile's sums: R rows x the block's two 8-column halves.
template <int R>
struct Avx2Sums {
  __m256 v[R][2];
};

// Calls steps(sums, begin, end) over [0, count) in chunks of kChunk, issuing an even share of
// `next`'s prefetches before each (one chunk when there is nothing to prefetch): the same k
// order as one pass. The chunks work on one local copy of `sums`: a lambda that updated the
// tile's own array (its address taken by the capture, and __m256 may alias the float loads
// of x) had GCC store all 2R sums back after every k step, 2R stores a step, which held the
// float32 tile to a third of its FMA rate; a copy per chunk still stored and reloaded them
// between chunks (docs/lab/38-the-avx2-small-gemms-were-store-bound.md). Forced inline, so the copy lives in registers.
template <int R, typename Steps>
__attribute__((always_inline)) inline void in_chunks(int64_t count, NextWeight next,
                                                     Avx2Sums<R>& sums, const Steps& steps) {
  const int64_t chunks = next.count == 0 ? 1 : (count + kChunk - 1) / kChunk;
  const int64_t chunk = next.count == 0 ? count : kChunk;
  const int64_t per_chunk = (next.count + chunks - 1) / chunks;
  Avx2Sums<R> local = sums;
  for (int64_t c = 0; c < chunks; ++c) {
    next.issue(per_chunk);
    steps(local, c * chunk, std::min(count, (c + 1) * chunk));
  }
  sums = local;
}

inline __m256 bias_half(const float* bias, int half) {
  return bias == nullptr ? _mm256_setzero_ps() : _mm256_loadu_ps(bias + half * 8);
}

// Rows [0, R) of x (float32) times one packed bfloat16 block at `w`, into y columns
// [col0, col0 + 16) clipped at n, rounded to bfloat16 as ATen rounds (nearest even).
template <int R, int B>
__attribute__((noinline)) void tile_avx2_bf16(
    const float* x, int64_t x_stride, const uint16_t* w, int64_t pairs, const float* bias,
    uint16_t* y, int64_t y_stride, int64_t col0, int64_t n, NextWeight next) {
  static_assert(B == 1, "one block of 16 columns per AVX2 tile");
  Avx2Sums<R> sums;
  for (int h = 0; h < 2; ++h) {
    const __m256 init = bias_half(bias, h);
    for (int r = 0; r < R; ++r) sums.v[r][h] = init;
  }
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  in_chunks<R>(pairs, next, sums, [&](Avx2Sums<R>& chunk, int64_t begin, int64_t end) {
    auto& acc = chunk.v;
    for (int64_t p = begin; p < end; ++p) {
      __m256 even[2], odd[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(w + p * 2 * kBlock + h * kBlock));
        even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      }
      for (int r = 0; r < R; ++r) {
        const __m256 xe = _mm256_broadcast_ss(x + r * x_stride + 2 * p);
        const __m256 xo = _mm256_broadcast_ss(x + r * x_stride + 2 * p + 1);
        for (int h = 0; h < 2; ++h) {
          acc[r][h] = _mm256_fmadd_ps(xo, odd[h], _mm256_fmadd_ps(xe, even[h], acc[r][h]));
        }
      }
    }
  });
  using Vec = at::vec::Vectorized<float>;
  for (int r = 0; r < R; ++r) {
    const auto out =
        at::vec::convert_from_float<at::BFloat16>(Vec(sums.v[r][0]), Vec(sums.v[r][1]));
    uint16_t* dst = y + r * y_stride + col0;
    if (col0 + kBlock <= n) {
      out.store(dst);
    } else if (col0 < n) {
      out.store(dst, static_cast<int>(n - col0));
    }
  }
}

// Rows [0, R) of x times one packed float32 block ([K][16]) at `w`, into y columns
// [col0, col0 + 16) clipped at n.
template <int R, int B>
__attribute__((noinline)) void tile_avx2_f32(const float* x, int64_t x_stride, const float* w,
                                             int64_t k, const float* bias, float* y,
                                             int64_t y_stride, int64_t col0, int64_t n,
                                             NextWeight next) {
  static_assert(B == 1, "one block of 16 columns per AVX2 tile");
  Avx2Sums<R> sums;
  for (int h = 0; h < 2; ++h) {
    const __m256 init = bias_half(bias, h);
    for (int r = 0; r < R; ++r) sums.v[r][h] = init;
  }
  in_chunks<R>(k, next, sums, [&](Avx2Sums<R>& chunk, int64_t begin, int64_t end) {
    auto& acc = chunk.v;
    for (int64_t p = begin; p < end; ++p) {
      const __m256 w0 = _mm256_loadu_ps(w + p * kBlock), w1 = _mm256_loadu_ps(w + p * kBlock + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + p);
        acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
      }
    }
  });
  for (int r = 0; r < R; ++r) {
    float* dst = y + r * y_stride + col0;
    if (col0 + kBlock <= n) {
      _mm256_storeu_ps(dst, sums.v[r][0]);
      _mm256_storeu_ps(dst + 8, sums.v[r][1]);
    } else if (col0 < n) {
      alignas(32) float tail[kBlock];
      _mm256_store_ps(tail, sums.v[r][0]);
      _mm256_store_ps(tail + 8, sums.v[r][1]);
      std::memcpy(dst, tail, (n - col0) * sizeof(float));
    }
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// Calls tile.template operator()<R, B>(blk, r0, next) over an m-row output of `blocks`
// column blocks of `block_bytes` each (packed contiguously from `w`) for every tile of R rows
// from r0 and B blocks from blk, split by for_each_column_unit (units of up to
// Shape::kBlocks, stealable: a call waits for no slow thread; columns only). Rows go in
// tiles of at most Shape::kRows, as even as they can be (7 rows as 4 + 3 rather than
// 6 + 1). A unit's row tiles share the prefetching of the owner's next unit's weight
// (`next`): the first row tile would otherwise stall on memory for the whole unit's weight
// (docs/lab/30-the-small-gemms-prefetch-their-next-weight.md).
template <typename Shape, typename Tile>
void for_each_tile(int64_t m, int64_t blocks, const void* w, int64_t block_bytes,
                   const Tile& tile) {
  constexpr int64_t kRows = Shape::kRows;
  const int64_t row_tiles = (m + kRows - 1) / kRows;
  for_each_column_unit(blocks, Shape::kBlocks, m, m, [&] {
    return [&](const ColumnUnit& u) {
      const char* next = static_cast<const char*>(w) + (u.blk + u.nb) * block_bytes;
      const int64_t lines = m >= kMinPrefetchRows ? u.next_nb * block_bytes / 64 : 0;
      for (int64_t t = 0; t < row_tiles; ++t) {
        const int64_t first = lines * t / row_tiles, count = lines * (t + 1) / row_tiles - first;
        const int64_t r0 = m * t / row_tiles;
        dispatch_tile<Shape::kRows, Shape::kBlocks>(
            m * (t + 1) / row_tiles - r0, u.nb, [&]<int R, int B>() {
              tile.template operator()<R, B>(u.blk, r0, NextWeight{next + first * 64, count});
            });
      }
    };
  });
}

#endif

#if defined(CPU_CAPABILITY_AVX512)
// for_each_tile with the tile shape for m rows.
template <typename Tile>
void for_each_tile(int64_t m, int64_t blocks, const void* w, int64_t block_bytes,
                   const Tile& tile) {
  if (m <= NarrowTile::kRows) {
    for_each_tile<NarrowTile>(m, blocks, w, block_bytes, tile);
  } else {
    for_each_tile<WideTile>(m, blocks, w, block_bytes, tile);
  }
}
#endif

#if defined(CARPOOL_AMX)
// The same product on AMX tiles (below), from the same packed weight: a block's 16 pairs of
// k rows are one B tile (16 x 64 bytes), 16 rows of x one A tile (x's own rows, its stride).

// The epilogue of one finished pair of row tiles x pair of column blocks: its sums (in a
// buffer the tiles were stored to) plus the bias, rounded to bfloat16 and stored to y, a few
// rows at a time. The next tiles' k loop runs it between its tile products (`step`), so the
// vector work overlaps the tile unit's instead of waiting for it.
//
// An output of more than kStreamedOutputBytes (an LM head's logits: 49,152 columns of 100 rows
// are 9.8 MB) is written by non-temporal stores where a row's 32 columns are one whole cache
// line. Its lines are in no cache (its buffer was last touched a step before), so an ordinary
// store first reads its line from memory, and those reads held the fill buffers that the
// weight stream needs; streamed, the same bits come much sooner (docs/lab/47-the-decoder-layers-in-one-c-call.md). Smaller
// outputs, which the next kernel reads from cache, keep ordinary stores.
constexpr int64_t kStreamedOutputBytes = int64_t{4} << 20;

struct PendingRows {
  const float* c = nullptr;  // c[r * 2 + b][16][16], as amx_tile_2x2 stores it
  uint16_t* y = nullptr;     // row 0 of the pair's rows, column 0
  int64_t n = 0, col = 0, next = 0, rows = 0, per_step = 0;
  __mmask32 mask = 0;        // the pair's columns [col, col + 32) clipped at n
  __m512 bias0, bias1;
  bool streamed = false;     // non-temporal stores (whole aligned lines only)

  CARPOOL_AMX_TARGET void run(int64_t count) {
    const int64_t stop = std::min(rows, next + count);
    for (; next < stop; ++next) {  // both blocks of a row: one conversion, one store
      const float* src = c + (next / 16) * 512 + (next % 16) * 16;  // block 1 at + 256
      const __m512 lo = _mm512_add_ps(_mm512_load_ps(src), bias0);
      const __m512 hi = _mm512_add_ps(_mm512_load_ps(src + 256), bias1);
      const __m512i out = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
      uint16_t* dst = y + next * n + col;
      if (streamed && mask == ~__mmask32{0} && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), out);
      } else {
        _mm512_mask_storeu_epi16(dst, mask, out);
      }
    }
  }
  CARPOOL_AMX_TARGET void step() { run(per_step); }
  CARPOOL_AMX_TARGET void finish() { run(rows); }
};

// The next column pair's weight panel (its two blocks are adjacent: one contiguous range),
// prefetched into L2 a few lines each k step of the current pair's tiles, so that it arrives
// from memory while the tile unit works instead of when its first tile loads ask for it
// (docs/lab/43-the-amx-small-gemm.md).
struct PanelPrefetch {
  const char* next = nullptr;
  int64_t left = 0, per_step = 0;
  CARPOOL_AMX_TARGET void step() {
    for (int64_t i = 0; i < per_step && left > 0; ++i, --left, next += 64)
      _mm_prefetch(next, _MM_HINT_T1);
  }
};

// c[r * 2 + b][16][16] = row tile r of x (rows from x0 and x1, their strides in bytes) times
// column block b, r < RT, b < BT (1 or 2 each): per k step 2 A and 2 B tiles feed 4 products
// (tiles 0-3 hold C, 4-5 A, 6-7 B). A first version kept 6 row tiles' C against one B tile (7
// tile loads for 6 products) and lost to oneDNN from 96 rows on; this one is ahead of it from
// 3 to 512 rows (docs/lab/43-the-amx-small-gemm.md). Each operand tile is reloaded for the next k step right after
// the products that read it are issued, so its load runs under the remaining products
// (docs/lab/44-the-amx-small-gemm-s-threads-steal.md).
// `pending` (the previous tiles' epilogue, whose buffer is not c) advances once a k step.
template <int RT, int BT>
CARPOOL_AMX_TARGET void amx_tile_2x2(const uint16_t* x0, int64_t x0_bytes, const uint16_t* x1,
                                      int64_t x1_bytes, const uint16_t* w,
                                      int64_t block_stride, int64_t ksteps, float* c,
                                      PendingRows& pending, PanelPrefetch& ahead) {
  _tile_zero(0);
  if constexpr (BT > 1) _tile_zero(1);
  if constexpr (RT > 1) _tile_zero(2);
  if constexpr (RT > 1 && BT > 1) _tile_zero(3);
  _tile_loadd(4, x0, x0_bytes);
  _tile_loadd(6, w, 64);
  if constexpr (BT > 1) _tile_loadd(7, w + block_stride, 64);
  if constexpr (RT > 1) _tile_loadd(5, x1, x1_bytes);
  for (int64_t j = 0; j < ksteps; ++j) {
    const bool more = j + 1 < ksteps;
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (BT > 1) _tile_dpbf16ps(1, 4, 7);
    if (more) _tile_loadd(4, x0 + (j + 1) * 32, x0_bytes);
    if constexpr (RT > 1) _tile_dpbf16ps(2, 5, 6);
    if (more) _tile_loadd(6, w + (j + 1) * 16 * 2 * kBlock, 64);
    if constexpr (RT > 1 && BT > 1) _tile_dpbf16ps(3, 5, 7);
    if constexpr (RT > 1) if (more) _tile_loadd(5, x1 + (j + 1) * 32, x1_bytes);
    if constexpr (BT > 1)
      if (more) _tile_loadd(7, w + block_stride + (j + 1) * 16 * 2 * kBlock, 64);
    pending.step();
    ahead.step();
  }
  _tile_stored(0, c, 64);
  if constexpr (BT > 1) _tile_stored(1, c + 256, 64);
  if constexpr (RT > 1) _tile_stored(2, c + 512, 64);
  if constexpr (RT > 1 && BT > 1) _tile_stored(3, c + 768, 64);
}

// y[m, n] = x[m, K] @ w.T (+ bias) on tiles: threads split the pairs of column blocks, each
// pair's weight (its B tiles) read from memory once and then from cache for every pair of
// row tiles; x_stride elements a row, K % 32 == 0. A unit of work is one pair over one block
// of rows; each thread owns the pairs of an even split, runs them block by block and then
// steals units from the back of the others' (`StealableShares`). A unit's sums are the same
// whichever thread runs it; stealing pays where one vCPU's tile unit runs slower than the
// other's (a shared VM) and costs nothing elsewhere (docs/lab/44-the-amx-small-gemm-s-threads-steal.md). A last partial row tile is
// read from `tail` instead: its rows copied into 16 rows of K zero-padded elements (the tile
// unit reads whole 16-row tiles; copying only these rows is cheaper than padding all of x).
// Two sum buffers alternate: the tiles of one step fill one while the other's epilogue runs.
// Up to kOneBlockRowTiles row tiles (256 rows: decode steps) run as one block of rows, so each
// column pair's weight is read from memory once. Larger calls run in blocks of
// kRowTilesPerBlock (96 rows), each block meeting all of the thread's column pairs while its
// x rows stay in L2; as one block, all of x streamed from L3 once per column pair
// (docs/lab/43-the-amx-small-gemm.md).
constexpr int64_t kOneBlockRowTiles = 16, kRowTilesPerBlock = 6;
CARPOOL_AMX_TARGET void amx_gemm(const uint16_t* x, int64_t x_stride, const uint16_t* tail,
                                 int64_t m, int64_t k, const uint16_t* w, int64_t blocks,
                                 const float* bias, uint16_t* y, int64_t n) {
  const int64_t block_stride = k * kBlock, row_tiles = (m + 15) / 16, ksteps = k / 32;
  const auto rows_of = [&](int64_t t) { return t < m / 16 ? x + t * 16 * x_stride : tail; };
  const auto bytes_of = [&](int64_t t) { return (t < m / 16 ? x_stride : k) * 2; };
  const int64_t pairs = (blocks + 1) / 2;
  const bool streamed = m * n * 2 > kStreamedOutputBytes;
  const int64_t tiles_per_block = row_tiles <= kOneBlockRowTiles ? row_tiles : kRowTilesPerBlock;
  const int64_t row_blocks = (row_tiles + tiles_per_block - 1) / tiles_per_block;
  // Thread s's share: row block by row block, its pairs [first_pair(s), first_pair(s + 1)).
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), pairs);
  const auto first_pair = [&](int64_t s) { return pairs * s / threads; };
  StealableShares shares(threads, [&](int64_t s) { return row_blocks * first_pair(s); });
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    // Zeros: a lone last block leaves its neighbour's sums unwritten (read, then masked off).
    alignas(64) float c[2][4 * 256] = {};
    PendingRows pending;
    int buffer = 0;
    for (int64_t own = begin; own < end; ++own) {
      for (auto claim = shares.next(own); claim.unit >= 0; claim = shares.next(own)) {
        const int64_t p0 = first_pair(claim.share), share_pairs = first_pair(claim.share + 1) - p0;
        const int64_t unit = claim.unit - row_blocks * p0;
        const int64_t pr = p0 + unit % share_pairs, tb = unit / share_pairs * tiles_per_block;
        const int64_t tb_end = std::min(row_tiles, tb + tiles_per_block);
        const int64_t blk0 = 2 * pr, nb = std::min<int64_t>(2, blocks - blk0);
        const uint16_t* wb = w + blk0 * block_stride;
        const int64_t col = blk0 * kBlock, cols = std::min(nb * kBlock, n - col);
        const __mmask32 mask = cols >= 32 ? ~__mmask32{0} : (__mmask32{1} << cols) - 1;
        const __m512 bias0 = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias + col);
        const __m512 bias1 = bias == nullptr || nb < 2 ? _mm512_setzero_ps()
                                                       : _mm512_loadu_ps(bias + col + kBlock);
        PanelPrefetch ahead;  // the share's next pair, when this one is the owner's own
        if (claim.share == own && pr + 1 < p0 + share_pairs) {
          const int64_t lines = std::min<int64_t>(2, blocks - blk0 - 2) * block_stride * 2 / 64;
          const int64_t steps = (tb_end - tb + 1) / 2 * ksteps;
          ahead = PanelPrefetch{reinterpret_cast<const char*>(wb + 2 * block_stride), lines,
                                (lines + steps - 1) / steps};
        }
        for (int64_t t0 = tb; t0 < tb_end; t0 += 2) {
          const int64_t nt = std::min<int64_t>(2, tb_end - t0);
          auto* tiles = nt == 2 ? (nb == 2 ? amx_tile_2x2<2, 2> : amx_tile_2x2<2, 1>)
                                : (nb == 2 ? amx_tile_2x2<1, 2> : amx_tile_2x2<1, 1>);
          tiles(rows_of(t0), bytes_of(t0), rows_of(t0 + 1), bytes_of(t0 + 1), wb, block_stride,
                ksteps, c[buffer], pending, ahead);
          pending.finish();
          const int64_t rows = std::min<int64_t>(nt * 16, m - t0 * 16);
          pending = PendingRows{c[buffer], y + t0 * 16 * n, n, col, 0, rows,
                                (rows + ksteps - 1) / ksteps, mask, bias0, bias1, streamed};
          buffer ^= 1;
        }
      }
    }
    pending.finish();
    if (streamed) _mm_sfence();  // the streamed rows visible before the call returns
    release_tiles();
  });
}

#endif

// The bias as float32 zero-padded to whole blocks (an undefined tensor without one).
at::Tensor padded_bias(const c10::optional<at::Tensor>& bias, int64_t n, int64_t blocks,
                       const at::TensorOptions& options, const char* caller) {
  if (!bias.has_value()) return at::Tensor();
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, caller, ": bias must be [n]");
  at::Tensor padded = at::zeros({blocks * kBlock}, options.dtype(at::kFloat));
  padded.narrow(0, 0, n).copy_(*bias);
  return padded;
}

}  // namespace

bool has_bf16_gemm() {
#if defined(CPU_CAPABILITY_AVX512)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

bool has_small_gemm_bf16() {
#if defined(CPU_CAPABILITY_AVX512)
  return has_bf16_gemm();
#elif defined(CPU_CAPABILITY_AVX2)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_bf16_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 &&
                  weight.dim() == 2 && weight.size(1) % 2 == 0,
              "pack_bf16_weight: weight must be a bfloat16 CPU [N, K] tensor with K even");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + kBlock - 1) / kBlock;
  at::Tensor packed = at::zeros({blocks, k / 2, kBlock, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.const_data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      for (int64_t c = 0; c < kBlock && blk * kBlock + c < n; ++c) {
        const uint16_t* row = src + (blk * kBlock + c) * k;
        uint16_t* out = dst + blk * k * kBlock + c * 2;
        for (int64_t p = 0; p < k / 2; ++p) {
          out[p * 2 * kBlock] = row[2 * p];
          out[p * 2 * kBlock + 1] = row[2 * p + 1];
        }
      }
    }
  });
  return packed;
}

at::Tensor small_gemm_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                           const c10::optional<at::Tensor>& bias, bool amx) {
  TORCH_CHECK(has_small_gemm_bf16(),
              "small_gemm_bf16: this build has neither AVX2 nor a CPU with AVX512-BF16");
  TORCH_CHECK(!amx || (amx_usable() && x.size(1) % 32 == 0),
              "small_gemm_bf16: amx needs a build and CPU with AMX (has_amx) and K a "
              "multiple of 32");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.stride(1) == 1,
              "small_gemm_bf16: x must be a bfloat16 CPU [M, K] tensor with contiguous rows");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == kBlock && packed.size(3) == 2 && packed.size(1) * 2 == x.size(1) &&
                  packed.size(0) == (n + kBlock - 1) / kBlock,
              "small_gemm_bf16: packed weight does not match x's K or n (use pack_bf16_weight)");
  const int64_t m = x.size(0), pairs = packed.size(1), blocks = packed.size(0);
  const at::Tensor bias_f = padded_bias(bias, n, blocks, x.options(), "small_gemm_bf16");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
#if defined(CARPOOL_AMX)
  if (amx) {
    const int64_t k = x.size(1), full_rows = m / 16 * 16;
    const uint16_t* xd = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
    std::vector<uint16_t> tail(full_rows < m ? 16 * k : 0);  // zeros
    for (int64_t r = full_rows; r < m; ++r)
      std::memcpy(tail.data() + (r - full_rows) * k, xd + r * x.stride(0), k * 2);
    amx_gemm(xd, x.stride(0), tail.data(), m, k,
             reinterpret_cast<const uint16_t*>(packed.const_data_ptr()), packed.size(0),
             bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr,
             reinterpret_cast<uint16_t*>(y.data_ptr()), n);
    return y;
  }
#endif
#if defined(CPU_CAPABILITY_AVX512)
  const uint16_t* xd = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  const uint16_t* wd = reinterpret_cast<const uint16_t*>(packed.const_data_ptr());
  const float* bd = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
  uint16_t* yd = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t x_stride = x.stride(0), block_stride = pairs * 2 * kBlock;
  for_each_tile(m, blocks, wd, block_stride * 2,
                [&]<int R, int B>(int64_t blk, int64_t r0, NextWeight next) {
    tile<R, B>(xd + r0 * x_stride, x_stride, wd + blk * block_stride, pairs, block_stride,
               bd == nullptr ? nullptr : bd + blk * kBlock, yd + r0 * n, n, blk * kBlock, n,
               next);
  });
#elif defined(CPU_CAPABILITY_AVX2)
  const at::Tensor x32 = x.to(at::kFloat).contiguous();  // widened once, broadcast per tile
  const float* xd = x32.const_data_ptr<float>();
  const uint16_t* wd = reinterpret_cast<const uint16_t*>(packed.const_data_ptr());
  const float* bd = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
  uint16_t* yd = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t k = x.size(1), block_stride = pairs * 2 * kBlock;
  for_each_tile<Avx2Bf16Tile>(m, blocks, wd, block_stride * 2,
                              [&]<int R, int B>(int64_t blk, int64_t r0, NextWeight next) {
    tile_avx2_bf16<R, B>(xd + r0 * k, k, wd + blk * block_stride, pairs,
                         bd == nullptr ? nullptr : bd + blk * kBlock, yd + r0 * n, n,
                         blk * kBlock, n, next);
  });
#endif
  return y;
}

bool has_f32_gemm() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_f32_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "pack_f32_weight: weight must be a float32 CPU [N, K] tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + kBlock - 1) / kBlock;
  at::Tensor packed = at::zeros({blocks, k, kBlock}, w.options());
  const float* src = w.const_data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      for (int64_t c = 0; c < kBlock && blk * kBlock + c < n; ++c) {
        const float* row = src + (blk * kBlock + c) * k;
        float* out = dst + blk * k * kBlock + c;
        for (int64_t p = 0; p < k; ++p) out[p * kBlock] = row[p];
      }
    }
  });
  return packed;
}

at::Tensor small_gemm_f32(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_f32_gemm(), "small_gemm_f32: this build has neither AVX-512 nor AVX2");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1,
              "small_gemm_f32: x must be a float32 CPU [M, K] tensor with contiguous rows");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == kBlock && packed.size(1) == x.size(1) &&
                  packed.size(0) == (n + kBlock - 1) / kBlock,
              "small_gemm_f32: packed weight does not match x's K or n (use pack_f32_weight)");
  const int64_t m = x.size(0), k = packed.size(1), blocks = packed.size(0);
  const at::Tensor bias_f = padded_bias(bias, n, blocks, x.options(), "small_gemm_f32");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const float* xd = x.const_data_ptr<float>();
  const float* wd = packed.const_data_ptr<float>();
  const float* bd = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
  float* yd = y.data_ptr<float>();
  const int64_t x_stride = x.stride(0), block_stride = k * kBlock;
#endif
#if defined(CPU_CAPABILITY_AVX512)
  for_each_tile(m, blocks, wd, block_stride * 4,
                [&]<int R, int B>(int64_t blk, int64_t r0, NextWeight next) {
    tile_f32<R, B>(xd + r0 * x_stride, x_stride, wd + blk * block_stride, k, block_stride,
                   bd == nullptr ? nullptr : bd + blk * kBlock, yd + r0 * n, n, blk * kBlock,
                   n, next);
  });
#elif defined(CPU_CAPABILITY_AVX2)
  for_each_tile<Avx2Tile>(m, blocks, wd, block_stride * 4,
                          [&]<int R, int B>(int64_t blk, int64_t r0, NextWeight next) {
    tile_avx2_f32<R, B>(xd + r0 * x_stride, x_stride, wd + blk * block_stride, k,
                        bd == nullptr ? nullptr : bd + blk * kBlock, yd + r0 * n, n,
                        blk * kBlock, n, next);
  });
#endif
  return y;
}

}  // namespace carpool_gemm
