// W8A8 linears (compressed-tensors' int8 weights with one scale per output column, inputs
// rounded to int8 per token with dynamic scales) as integer products, as vLLM runs them:
//
//   y[m, n] = float(sum_k qx[m, k] * qw[n, k]) * sx[m] * sw[n]  (+ bias[n])
//
// in float32, rounded to x's dtype once (as it is stored: no float32 copy of y). qx and sx are int8_per_token's (elementwise/
// int8_rows.cpp: the bits of the model's eager rounding), so the int32 sum is exact and the
// only roundings are the conversion to float32 and the two products (kernels/reference.py's
// w8a8_linear_reference holds the same definition).
//
// The weight is packed once (pack_w8a8_weight, layout in quant_weight.h): blocks of 16 columns,
// per 4 k one 64-byte row of 16 dwords, so one `vpdpbusd` (AVX512-VNNI: u8 x s8, 4 products
// summed into each int32 lane) takes 4 k of 16 columns for one row. Its unsigned operand is
// the activations shifted by 128 (q + 128, from int8_per_token_u8), so each column's sum is
// sum (q + 128) qw - 128 sum qw, the second term packed as `col_sums`. Without VNNI (AVX2 and
// AVX-512 builds without it) the same sums come from `vpmaddwd` on both operands widened to
// int16 (pairs of products, exact in int32); DEFAULT builds sum in scalars.
//
// Tiles of R rows x B blocks keep R * B int32 accumulators over the whole K; threads split the
// column blocks, each walking rows in blocks of kRowBlock so a row block's activations stay in
// cache while its share of the weight streams past. Every row's sums are exact and its
// rescale per element, so a row's result is the same bits in any batch.

// The rescale is two products and a sum, each rounded: no fused multiply-add.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "gemm/quant_weight.h"
#include "gemm/stealable_shares.h"
#include "kernel_api.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VNNI__)
#define CARPOOL_W8A8_VNNI 1
#elif defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#define CARPOOL_W8A8_MADD 1
#endif

namespace carpool_gemm {

namespace {

constexpr int64_t kBlock = QuantWeight::kBlock;
constexpr int64_t kQuad = 64;  // bytes of 4 k x 16 columns
constexpr int64_t kRowBlock = 64;

struct Call {
  const QuantWeight* w;
  const uint8_t* xq;   // [m][kp]: q + 128
  int64_t kp;
  const float* sx;     // [m]
  const float* bias;   // padded to whole blocks, or null
  void* y;             // [m][n] in x's dtype
  int64_t n;
  bool bf16;           // y bfloat16 (else float32)
};

inline int32_t load_u32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Row r's outputs of block blk (its columns below n) from their 16 int32 sums (biased by
// 128 * col_sums), in y's dtype: bfloat16 rounded to nearest even, as Tensor.to rounds.
inline void rescale16(const Call& c, int64_t r, int64_t blk, const int32_t* sums) {
  const int32_t* comp = c.w->col_sums.const_data_ptr<int32_t>() + blk * kBlock;
  const float* sw = c.w->col_scales.const_data_ptr<float>() + blk * kBlock;
  const float sx = c.sx[r];
  const int64_t cols = std::min(kBlock, c.n - blk * kBlock);
  for (int64_t i = 0; i < cols; ++i) {
    float v = static_cast<float>(sums[i] - comp[i]) * sx;
    v = v * sw[i];
    if (c.bias != nullptr) v = v + c.bias[blk * kBlock + i];
    const int64_t at = r * c.n + blk * kBlock + i;
    if (c.bf16) {
      static_cast<c10::BFloat16*>(c.y)[at] = c10::BFloat16(v);
    } else {
      static_cast<float*>(c.y)[at] = v;
    }
  }
}

#if defined(CARPOOL_W8A8_VNNI)
// 6 rows x 4 blocks: 24 accumulators, 4 weight vectors, one broadcast (32 registers); a row
// or two take 8 blocks so that one row still has 8 independent chains.
struct ManyRows { static constexpr int kRows = 6, kBlocks = 4; };
struct FewRows { static constexpr int kRows = 2, kBlocks = 8; };

// (Flat arrays and full unrolling: GCC keeps an [R][B] array of vectors in memory, storing
// every accumulator each k step.)
template <int R, int B>
__attribute__((noinline)) void tile(const Call& c, int64_t r0, int64_t blk) {
  const int64_t quads = c.kp / 4, block_bytes = c.w->block_bytes();
  const uint8_t* wb = c.w->data.const_data_ptr<uint8_t>() + blk * block_bytes;
  const uint8_t* x = c.xq + r0 * c.kp;
  __m512i acc[R * B];
#pragma GCC unroll 32
  for (int i = 0; i < R * B; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t q = 0; q < quads; ++q) {
    __m512i wv[B];
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) wv[b] = _mm512_loadu_si512(wb + b * block_bytes + q * kQuad);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_set1_epi32(load_u32(x + r * c.kp + q * 4));
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) acc[r * B + b] = _mm512_dpbusd_epi32(acc[r * B + b], xv, wv[b]);
    }
  }
  // (through memory: read in the loop below, GCC would keep acc in memory throughout)
  alignas(64) int32_t sums[R * B][kBlock];
#pragma GCC unroll 32
  for (int i = 0; i < R * B; ++i) _mm512_store_si512(sums[i], acc[i]);
  // (sum - 128 col_sums) * sx * sw (+ bias), stored as y's dtype: bfloat16 rounded to
  // nearest even as c10::BFloat16 rounds (a NaN as 0x7fc0)
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff),
                nan16 = _mm512_set1_epi32(0x7fc0);
  for (int b = 0; b < B; ++b) {
    const int64_t col0 = (blk + b) * kBlock;
    const __mmask16 mask = col0 + kBlock <= c.n ? 0xFFFF : (1u << (c.n - col0)) - 1;
    const __m512i comp = _mm512_loadu_si512(c.w->col_sums.const_data_ptr<int32_t>() + col0);
    const __m512 sw = _mm512_loadu_ps(c.w->col_scales.const_data_ptr<float>() + col0);
    const __m512 bias = c.bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(c.bias + col0);
    for (int r = 0; r < R; ++r) {
      const __m512i sum = _mm512_sub_epi32(_mm512_load_si512(sums[r * B + b]), comp);
      __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(c.sx[r0 + r]));
      v = _mm512_mul_ps(v, sw);
      if (c.bias != nullptr) v = _mm512_add_ps(v, bias);
      const int64_t at = (r0 + r) * c.n + col0;
      if (c.bf16) {
        const __m512i u = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
        __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, half)), 16);
        h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan16);
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(c.y) + at, mask,
                                 _mm512_cvtepi32_epi16(h));
      } else {
        _mm512_mask_storeu_ps(static_cast<float*>(c.y) + at, mask, v);
      }
    }
  }
}
#elif defined(CARPOOL_W8A8_MADD)
// 16 ymm registers: 4 accumulators a row and block (4 columns x 2 pairs of k each).
struct ManyRows { static constexpr int kRows = 2, kBlocks = 1; };
struct FewRows { static constexpr int kRows = 1, kBlocks = 2; };

template <int R, int B>
__attribute__((noinline)) void tile(const Call& c, int64_t r0, int64_t blk) {
  const int64_t quads = c.kp / 4, block_bytes = c.w->block_bytes();
  const uint8_t* wb = c.w->data.const_data_ptr<uint8_t>() + blk * block_bytes;
  const uint8_t* x = c.xq + r0 * c.kp;
  // acc[(r * B + b) * 4 + j]: block b's columns 4j..4j + 3, lanes (column, k pair):
  // [c0 p0, c0 p1, c1 p0, c1 p1 | c2 .., c3 ..]
  __m256i acc[R * B * 4];
#pragma GCC unroll 16
  for (int i = 0; i < R * B * 4; ++i) acc[i] = _mm256_setzero_si256();
  for (int64_t q = 0; q < quads; ++q) {
    __m256i xv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      // the quad's 4 bytes widened to int16, repeated: (x0, x1, x2, x3) x 4
      const __m128i x4 = _mm_cvtepu8_epi16(_mm_cvtsi32_si128(load_u32(x + r * c.kp + q * 4)));
      xv[r] = _mm256_broadcastq_epi64(x4);
    }
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(wb + b * block_bytes + q * kQuad + j * 16)));
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          __m256i& a = acc[(r * B + b) * 4 + j];
          a = _mm256_add_epi32(a, _mm256_madd_epi16(w16, xv[r]));
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < B; ++b) {
      const __m256i* a = acc + (r * B + b) * 4;
      alignas(32) int32_t sums[kBlock];
      // pairs summed: [c0, c1, c4, c5 | c2, c3, c6, c7] -> columns in order
      const __m256i lo = _mm256_permute4x64_epi64(_mm256_hadd_epi32(a[0], a[1]), 0xD8);
      const __m256i hi = _mm256_permute4x64_epi64(_mm256_hadd_epi32(a[2], a[3]), 0xD8);
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums), lo);
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums + 8), hi);
      rescale16(c, r0 + r, blk + b, sums);
    }
  }
}
#else
struct ManyRows { static constexpr int kRows = 1, kBlocks = 1; };
struct FewRows { static constexpr int kRows = 1, kBlocks = 1; };

template <int R, int B>
__attribute__((noinline)) void tile(const Call& c, int64_t r0, int64_t blk) {
  const int64_t block_bytes = c.w->block_bytes();
  for (int b = 0; b < B; ++b) {
    const int8_t* wb = reinterpret_cast<const int8_t*>(c.w->data.const_data_ptr<uint8_t>()) +
                       (blk + b) * block_bytes;
    for (int r = 0; r < R; ++r) {
      const uint8_t* x = c.xq + (r0 + r) * c.kp;
      int32_t sums[kBlock] = {};
      for (int64_t k = 0; k < c.kp; ++k)
        for (int64_t i = 0; i < kBlock; ++i)
          sums[i] += static_cast<int32_t>(x[k]) * wb[(k / 4) * kQuad + i * 4 + k % 4];
      rescale16(c, r0 + r, blk + b, sums);
    }
  }
}
#endif

template <int MaxR, int MaxB>
void run_tile(const Call& c, int64_t rows, int64_t nb, int64_t r0, int64_t blk) {
  if constexpr (MaxB > 1) {
    if (nb < MaxB) return run_tile<MaxR, MaxB - 1>(c, rows, nb, r0, blk);
  }
  if constexpr (MaxR > 1) {
    if (rows < MaxR) return run_tile<MaxR - 1, MaxB>(c, rows, nb, r0, blk);
  }
  tile<MaxR, MaxB>(c, r0, blk);
}

// The split of for_each_column_unit: units of up to Shape::kBlocks blocks, each over a row
// block in tiles as even as they can be.
template <typename Shape>
void run_call(const Call& c, int64_t m) {
  for_each_column_unit(c.w->blocks(), Shape::kBlocks, m, kRowBlock, [&] {
    return [&](const ColumnUnit& u) {
      for_each_row_tile(u.rows, Shape::kRows, [&](int64_t r0, int64_t rows) {
        run_tile<Shape::kRows, Shape::kBlocks>(c, rows, u.nb, u.r0 + r0, u.blk);
      });
    };
  });
}

}  // namespace

QuantWeight pack_w8a8_weight(const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.dim() == 2 &&
                  qweight.scalar_type() == at::kChar,
              "pack_w8a8_weight: qweight must be a CPU int8 [N, K] tensor, got ",
              qweight.scalar_type(), " ", qweight.sizes());
  const int64_t n = qweight.size(0), k = qweight.size(1);
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kFloat &&
                  scales.numel() == n && (scales.dim() == 1 || (scales.dim() == 2 &&
                                                                scales.size(1) == 1)),
              "pack_w8a8_weight: scales must be float32 [N] or [N, 1] (one per column), N = ",
              n, ", got ", scales.scalar_type(), " ", scales.sizes());
  QuantWeight w;
  w.n = n;
  w.k = k;
  w.bits = 8;
  w.group_size = k;
  w.w8a8 = true;
  const int64_t blocks = w.blocks(), block_bytes = w.block_bytes();
  w.data = at::zeros({blocks, block_bytes}, qweight.options().dtype(at::kByte));
  w.col_scales = at::zeros({blocks * kBlock}, qweight.options().dtype(at::kFloat));
  w.col_sums = at::zeros({blocks * kBlock}, qweight.options().dtype(at::kInt));
  w.col_scales.narrow(0, 0, n).copy_(scales.reshape({n}));
  const at::Tensor q = qweight.contiguous();
  const int8_t* qd = q.const_data_ptr<int8_t>();
  uint8_t* out = w.data.data_ptr<uint8_t>();
  int32_t* sums = w.col_sums.data_ptr<int32_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      for (int64_t c = 0; c < kBlock && blk * kBlock + c < n; ++c) {
        const int8_t* src = qd + (blk * kBlock + c) * k;
        int32_t sum = 0;
        for (int64_t i = 0; i < k; ++i) {
          out[blk * block_bytes + (i / 4) * kQuad + c * 4 + i % 4] = static_cast<uint8_t>(src[i]);
          sum += src[i];
        }
        sums[blk * kBlock + c] = 128 * sum;
      }
    }
  });
  return w;
}

at::Tensor w8a8_linear(const at::Tensor& x, const QuantWeight& w,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.w8a8, "w8a8_linear: the weight was not packed by pack_w8a8_weight");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "w8a8_linear: x must be a float32 or bfloat16 CPU [M, K] tensor, got ",
              x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) == w.k, "w8a8_linear: x has K = ", x.size(1),
              " columns, the packed weight K = ", w.k);
  // K * 128 * 255 must fit an int32 sum (the shifted operand is 0..255)
  TORCH_CHECK(w.k <= (int64_t{1} << 16), "w8a8_linear: K above 65536 is not supported");
  const int64_t m = x.size(0), n = w.n, blocks = w.blocks(), kp = w.kp();
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && at::isFloatingType(bias->scalar_type()),
                "w8a8_linear: bias must be a floating [N] = [", n, "] tensor, got ",
                bias->scalar_type(), " ", bias->sizes());
    bias_f = at::zeros({blocks * kBlock}, x.options().dtype(at::kFloat));
    bias_f.narrow(0, 0, n).copy_(*bias);
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m > 0 && n > 0) {
    const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
    // every byte written by int8_per_token_u8 (its padding too): no zeroing first
    const std::unique_ptr<uint8_t[]> xq(new uint8_t[m * kp]);
    std::vector<float> sx(m);
    carpool_fused::int8_per_token_u8(xc, xq.get(), kp, sx.data());
    const Call call{&w, xq.get(), kp, sx.data(),
                    bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr,
                    y.data_ptr(), n, x.scalar_type() == at::kBFloat16};
    if (m <= FewRows::kRows) {
      run_call<FewRows>(call, m);
    } else {
      run_call<ManyRows>(call, m);
    }
  }
  return y;
}

}  // namespace carpool_gemm
