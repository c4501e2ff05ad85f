// Quantized linear layers for a few rows: y = x @ W.T (+ bias), W dequantized in registers.
//
// The weight is carpool's canonical quantized form (8-bit q, or 4-bit q in ggml's nibble
// order; float32 scales and optional mins per group of g consecutive k; W = scales * q + mins),
// packed once by pack_quant_weight into blocks of 16 output columns that stream front to back
// (quant_weight.h has both layouts). A decode step is a pass over its weights, so reading 1
// (int8) or 0.5 (int4) bytes a weight instead of bfloat16's 2 is what makes it faster.
//
// A tile of R rows x B blocks keeps, per group, partial sums of x[r, k] * q[k] (q widened to
// float32: exact), then folds them in: acc += part * scale, and with mins acc += sum_k(x[r, k])
// * min, the row's group sums of x computed once per call. So a k step costs one widening and
// R multiply-adds per 16 columns, the scales and mins a few per group, and every weight byte
// is loaded once per row tile (the tiles of a call share a block while it is in cache).
//
// A row's sums run over its groups and each group's k in one fixed order whatever the number
// of rows, its tile or its thread (threads split the columns only): row m's result is the same
// bits alone or in any batch. x is read as float32 (bfloat16 rows widened once, exactly), the
// sums are float32, the result rounded to x's dtype once. bfloat16 rows on AVX512-BF16 CPUs
// take `vdpbf16ps` on q as bfloat16 instead (quant_bf16_tiles.h): the same group sums, twice
// the multiply-adds a cycle.
//
// One source for every build: `Isa` (quant_isa.h) is a 16-column block as one AVX-512
// register, two AVX2 ones, or 16 scalars (DEFAULT builds, no vector code).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gemm/quant_isa.h"
#include "gemm/quant_weight.h"
#include "gemm/stealable_shares.h"
#include "kernel_api.h"
#include "runtime/prefetch.h"

namespace carpool_gemm {

namespace {

constexpr int64_t kBlock = QuantWeight::kBlock;
constexpr int64_t kUnit4 = 256;  // bytes of 32 k x 16 columns at 4 bits (quant_weight.h)
constexpr int64_t kUnit5 = 320;  // and at 5 bits

#if defined(CPU_CAPABILITY_AVX512)
// Tiles: up to 2 rows x 4 blocks (a row's 4 blocks are 4 independent chains of sums, which
// one row needs to keep the multiply-adds busy), else up to 6 rows x 2 blocks (24 + 24 sums).
struct FewRows { static constexpr int kRows = 2, kBlocks = 4; };
struct ManyRows { static constexpr int kRows = 6, kBlocks = 2; };
#elif defined(CPU_CAPABILITY_AVX2)
// 16 registers: a block is two, so one row takes 2 blocks (4 chains), more rows 1 block.
struct FewRows { static constexpr int kRows = 1, kBlocks = 2; };
struct ManyRows { static constexpr int kRows = 3, kBlocks = 1; };
#else
struct FewRows { static constexpr int kRows = 1, kBlocks = 1; };
struct ManyRows { static constexpr int kRows = 1, kBlocks = 1; };
#endif

// Whether tiles of this packing prefetch their weight streams (runtime/prefetch.h): 4 and 5
// bits, whose unpacking spaces the reads out; 8- and 6-bit passes, nearer the memory's rate,
// gained nothing at two threads (docs/lab/61-prefetched-weight-streams.md).
template <int Bits>
constexpr bool kPrefetchStreams = Bits == 4 || Bits == 5;

using F = Isa::F;
constexpr int kVecs = kBlock / Isa::kLanes;  // registers a block of 16 columns takes

// What every tile of one call shares.
struct Call {
  const QuantWeight* w;
  const float* x;      // float32 rows, x_stride apart
  int64_t x_stride;
  const float* xsum;   // [m][groups]: each row's sum of x over each group (with mins only)
  const float* bias;   // padded to whole blocks, or null
  float* y;            // [m][blocks * 16]
  const uint16_t* xb = nullptr;  // bfloat16 rows in pair order (quant_bf16_tiles.h), or null
  int64_t xb_stride = 0;
};

// The fold of one group's partial sums into the row sums: acc += part * scale (+ the rows'
// group sums of x * min), for B blocks whose group header starts at `head`.
template <int R, int B, bool Mins>
__attribute__((always_inline)) inline void fold_group(const Call& call, int64_t r0, int64_t grp,
                                                       const uint8_t* head, int64_t block_bytes,
                                                       F (&part)[R][B * kVecs],
                                                       F (&acc)[R][B * kVecs]) {
  const int64_t groups = call.w->groups();
  const bool f16 = call.w->f16_header;
  for (int b = 0; b < B; ++b) {
    const uint8_t* scales = head + b * block_bytes;
    for (int h = 0; h < kVecs; ++h) {
      const int v = b * kVecs + h;
      const F s = header_load(scales, h * Isa::kLanes, f16);
      for (int r = 0; r < R; ++r) acc[r][v] = Isa::fma(part[r][v], s, acc[r][v]);
      if constexpr (Mins) {
        const F m = header_load(scales, kBlock + h * Isa::kLanes, f16);
        for (int r = 0; r < R; ++r)
          acc[r][v] = Isa::fma(Isa::bcast(call.xsum + (r0 + r) * groups + grp), m, acc[r][v]);
      }
    }
  }
}

template <int R, int B>
__attribute__((always_inline)) inline void store_rows(const Call& call, int64_t r0, int64_t blk,
                                                       F (&acc)[R][B * kVecs]) {
  const int64_t y_stride = call.w->blocks() * kBlock;
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < B * kVecs; ++v)
      Isa::store(call.y + (r0 + r) * y_stride + blk * kBlock + v * Isa::kLanes, acc[r][v]);
}

// Rows [r0, r0 + R) times blocks [blk, blk + B) into y. Never inlined: one call a tile is
// nothing next to its k loop, and each shape keeps its own registers.
template <int R, int B, int Bits, bool Mins>
__attribute__((noinline)) void tile(const Call& call, int64_t r0, int64_t blk) {
  constexpr int V = B * kVecs;
  const QuantWeight& w = *call.w;
  const int64_t g = w.group_size, groups = w.groups(), group_bytes = w.group_bytes(),
                block_bytes = w.block_bytes(), header = w.header_bytes();
  const uint8_t* base = w.data.const_data_ptr<uint8_t>() + blk * block_bytes;
  const float* x = call.x + r0 * call.x_stride;
  const int64_t xs = call.x_stride;
  F acc[R][V];
  for (int v = 0; v < V; ++v) {
    const F init = call.bias == nullptr ? Isa::zero()
                                        : Isa::load(call.bias + blk * kBlock + v * Isa::kLanes);
    for (int r = 0; r < R; ++r) acc[r][v] = init;
  }
  for (int64_t grp = 0; grp < groups; ++grp) {
    const uint8_t* group = base + grp * group_bytes;
    if constexpr (kPrefetchStreams<Bits>) prefetch_streams<B>(group, block_bytes, group_bytes);
    const uint8_t* q = group + header;
    const float* xg = x + grp * g;
    F part[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) part[r][v] = Isa::zero();
    if constexpr (Bits == 8) {
      for (int64_t i = 0; i < g; ++i) {
        F wv[V];
        for (int b = 0; b < B; ++b)
          for (int h = 0; h < kVecs; ++h)
            wv[b * kVecs + h] = Isa::i8(q + b * block_bytes + i * kBlock + h * Isa::kLanes);
        for (int r = 0; r < R; ++r) {
          const F xv = Isa::bcast(xg + r * xs + i);
          for (int v = 0; v < V; ++v) part[r][v] = Isa::fma(xv, wv[v], part[r][v]);
        }
      }
    } else if constexpr (Bits == 6) {
      // bits 8's sums in its order, k then k + 1
      for (int64_t p = 0; p < g / 2; ++p) {
        F lo[V], hi[V];
        for (int b = 0; b < B; ++b)
          for (int h = 0; h < kVecs; ++h)
            Isa::i8_pair(q + b * block_bytes, p, h * Isa::kLanes, lo[b * kVecs + h],
                         hi[b * kVecs + h]);
        for (int r = 0; r < R; ++r) {
          const F xl = Isa::bcast(xg + r * xs + 2 * p);
          const F xh = Isa::bcast(xg + r * xs + 2 * p + 1);
          for (int v = 0; v < V; ++v)
            part[r][v] = Isa::fma(xh, hi[v], Isa::fma(xl, lo[v], part[r][v]));
        }
      }
    } else {
      for (int64_t u = 0; u < g / 32; ++u) {
        for (int64_t j = 0; j < 16; ++j) {
          F lo[V], hi[V];
          for (int b = 0; b < B; ++b) {
            const uint8_t* unit = q + b * block_bytes + u * (Bits == 5 ? kUnit5 : kUnit4);
            for (int h = 0; h < kVecs; ++h) {
              if constexpr (Bits == 5) {
                Isa::u5(unit, j, h * Isa::kLanes, lo[b * kVecs + h], hi[b * kVecs + h]);
              } else {
                Isa::u4(unit, j, h * Isa::kLanes, lo[b * kVecs + h], hi[b * kVecs + h]);
              }
            }
          }
          for (int r = 0; r < R; ++r) {
            const F xl = Isa::bcast(xg + r * xs + u * 32 + j);
            const F xh = Isa::bcast(xg + r * xs + u * 32 + 16 + j);
            for (int v = 0; v < V; ++v)
              part[r][v] = Isa::fma(xh, hi[v], Isa::fma(xl, lo[v], part[r][v]));
          }
        }
      }
    }
    fold_group<R, B, Mins>(call, r0, grp, group, block_bytes, part, acc);
  }
  store_rows<R, B>(call, r0, blk, acc);
}

// Calls tile<R, B, Bits, Mins> with R == rows (1..MaxR) and B == nb (1..MaxB).
template <int MaxR, int MaxB, int Bits, bool Mins>
void run_tile(const Call& call, int64_t rows, int64_t nb, int64_t r0, int64_t blk) {
  if constexpr (MaxB > 1) {
    if (nb < MaxB) return run_tile<MaxR, MaxB - 1, Bits, Mins>(call, rows, nb, r0, blk);
  }
  if constexpr (MaxR > 1) {
    if (rows < MaxR) return run_tile<MaxR - 1, MaxB, Bits, Mins>(call, rows, nb, r0, blk);
  }
  tile<MaxR, MaxB, Bits, Mins>(call, r0, blk);
}

// Rows in blocks of up to kRowBlock: each thread runs its columns for one block of rows
// before the next, so a block's x rows stay in cache while the weight streams past; a call of
// up to kRowBlock rows (every decode step) reads the weight from memory once.
constexpr int64_t kRowBlock = 64;

#include "gemm/quant_bf16_tiles.h"
#include "gemm/quant_bf16_rounded.h"

// The whole product, split by for_each_column_unit: units of up to Shape::kBlocks blocks,
// each over a row block in tiles of at most Shape::kRows, as even as they can be (7 rows as
// 4 + 3 rather than 6 + 1).
template <typename Shape, int Bits, bool Mins>
void run_call(const Call& call, int64_t m) {
  for_each_column_unit(call.w->blocks(), Shape::kBlocks, m, kRowBlock, [&] {
    return [&](const ColumnUnit& u) {
      for_each_row_tile(u.rows, Shape::kRows, [&](int64_t r0, int64_t rows) {
        run_tile<Shape::kRows, Shape::kBlocks, Bits, Mins>(call, rows, u.nb, u.r0 + r0, u.blk);
      });
    };
  });
}

template <int Bits, bool Mins>
void run_call(const Call& call, int64_t m) {
  if (m <= FewRows::kRows) {
    run_call<FewRows, Bits, Mins>(call, m);
  } else {
    run_call<ManyRows, Bits, Mins>(call, m);
  }
}

// The three paths as types, for by_bits.
struct Float {
  template <int Bits, bool Mins> static void run(const Call& c, int64_t m) { run_call<Bits, Mins>(c, m); }
};
struct Pairs {
  template <int Bits, bool Mins> static void run(const Call& c, int64_t m) { run_call_bf16<Bits, Mins>(c, m); }
};
struct Rounded {
  template <int Bits, bool Mins> static void run(const Call& c, int64_t m) { run_call_rounded<Bits, Mins>(c, m); }
};

// Path::run for the weight's packing and mins.
template <typename Path>
void by_bits(const QuantWeight& w, const Call& call, int64_t m) {
  const auto go = [&](auto bits) {
    constexpr int Bits = decltype(bits)::value;
    w.has_mins ? Path::template run<Bits, true>(call, m) : Path::template run<Bits, false>(call, m);
  };
  switch (w.bits) {
    case 8: return go(std::integral_constant<int, 8>{});
    case 6: return go(std::integral_constant<int, 6>{});
    case 5: return go(std::integral_constant<int, 5>{});
    default: return go(std::integral_constant<int, 4>{});
  }
}

}  // namespace

at::Tensor quant_linear(const at::Tensor& x, const QuantWeight& w,
                        const c10::optional<at::Tensor>& bias, int64_t rounded_from) {
  if (w.w8a8) return w8a8_linear(x, w, bias);  // the input rounded per token, int8 x int8
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear: x must be a float32 or bfloat16 CPU [M, K] tensor, got ",
              x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) == w.k, "quant_linear: x has K = ", x.size(1),
              " columns, the packed weight K = ", w.k);
  const int64_t m = x.size(0), n = w.n, blocks = w.blocks(), groups = w.groups();
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && at::isFloatingType(bias->scalar_type()),
                "quant_linear: bias must be a floating [N] = [", n, "] tensor, got ",
                bias->scalar_type(), " ", bias->sizes());
    bias_f = at::zeros({blocks * kBlock}, x.options().dtype(at::kFloat));
    bias_f.narrow(0, 0, n).copy_(*bias);
  }
  const bool pairs = takes_bf16_pairs(x, w);
  // Rows contiguous within a row. The pairs path reads bfloat16 rows as they are (4 and 5
  // bits: copied into pair order below); the float32 path reads float32 rows, bfloat16 ones
  // widened once, exactly.
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor x32 = pairs || x.scalar_type() == at::kFloat ? xc : xc.to(at::kFloat);
  at::Tensor y = at::empty({m, blocks * kBlock}, x.options().dtype(at::kFloat));
  if (m > 0 && n > 0) {
    const int64_t x_stride = x32.stride(0), g = w.group_size;
    // x[r][i] as float32 (exact for bfloat16)
    const auto x_at = [&](int64_t r, int64_t i) {
      if (x32.scalar_type() == at::kFloat) return x32.const_data_ptr<float>()[r * x_stride + i];
      uint16_t bits;
      std::memcpy(&bits, static_cast<const uint8_t*>(x32.const_data_ptr()) +
                             (r * x_stride + i) * 2, 2);
      const uint32_t wide = static_cast<uint32_t>(bits) << 16;
      float v;
      std::memcpy(&v, &wide, 4);
      return v;
    };
    std::vector<float> xsum(w.has_mins ? m * groups : 0);
    for (int64_t r = 0; r < (w.has_mins ? m : 0); ++r) {
      for (int64_t grp = 0; grp < groups; ++grp) {
        float sum = 0.0f;
        for (int64_t i = 0; i < g; ++i) sum += x_at(r, grp * g + i);
        xsum[r * groups + grp] = sum;
      }
    }
    Call call{&w, pairs ? nullptr : x32.const_data_ptr<float>(), x_stride, xsum.data(),
              bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr, y.data_ptr<float>()};
    std::vector<uint16_t> x_pairs;
    if (pairs) {
      // 8 bits: x's own rows, pairs (k, k + 1); 4, 5 bits: each 32 k as (k0 + j, k0 + 16 + j)
      const uint16_t* xb = reinterpret_cast<const uint16_t*>(x32.const_data_ptr());
      call.xb = xb;
      call.xb_stride = x_stride;
      if (w.bits == 4 || w.bits == 5) {
        x_pairs.resize(m * w.k);
        for (int64_t r = 0; r < m; ++r) {
          for (int64_t k0 = 0; k0 < w.k; k0 += 32) {
            const uint16_t* src = xb + r * x_stride + k0;
            uint16_t* dst = x_pairs.data() + r * w.k + k0;
            for (int64_t j = 0; j < 16; ++j) {
              dst[2 * j] = src[j];
              dst[2 * j + 1] = src[16 + j];
            }
          }
        }
        call.xb = x_pairs.data();
        call.xb_stride = w.k;
      }
      if (rounded_from > 0 && m >= rounded_from) {
        by_bits<Rounded>(w, call, m);
      } else {
        by_bits<Pairs>(w, call, m);
      }
    } else {
      by_bits<Float>(w, call, m);
    }
  }
  at::Tensor out = blocks * kBlock == n ? y : y.narrow(1, 0, n);
  return x.scalar_type() == at::kFloat ? out.contiguous() : out.to(x.scalar_type());
}

}  // namespace carpool_gemm
