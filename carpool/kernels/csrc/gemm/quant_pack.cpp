// The quantized weight's packing (canonical form -> QuantWeight, once at load) and its
// dequantization back to float rows (dequantize_rows: what calls of many rows multiply by
// with oneDNN). The layout is described in quant_weight.h; the kernel reading it in quant_gemm.cpp.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <cstring>

#include "gemm/quant_isa.h"
#include "gemm/quant_weight.h"

namespace carpool_gemm {

namespace {

using F = Isa::F;
constexpr int64_t kBlock = QuantWeight::kBlock;
constexpr int kVecs = kBlock / Isa::kLanes;

// Block `blk`'s 16 columns of W, k by k, into wt (float32 [K][ld], from its column 0): each
// 16 columns of one k one fused multiply-add of q by the group's scale and min.
template <int Bits, bool Mins>
void dequantize_block(const QuantWeight& w, int64_t blk, float* wt, int64_t ld) {
  const int64_t g = w.group_size, header = w.header_bytes();
  const uint8_t* block = w.data.const_data_ptr<uint8_t>() + blk * w.block_bytes();
  for (int64_t grp = 0; grp < w.groups(); ++grp) {
    const uint8_t* group = block + grp * w.group_bytes();
    const uint8_t* q = group + header;
    const float* head = reinterpret_cast<const float*>(group);
    float* out = wt + grp * g * ld;
    for (int h = 0; h < kVecs; ++h) {
      const int64_t c = h * Isa::kLanes;
      const F s = Isa::load(head + c), m = Mins ? Isa::load(head + kBlock + c) : Isa::zero();
      if constexpr (Bits == 8) {
        for (int64_t i = 0; i < g; ++i)
          Isa::store(out + i * ld + c, Isa::fma(Isa::i8(q + i * kBlock + c), s, m));
      } else {
        for (int64_t u = 0; u < g / 32; ++u) {
          for (int64_t j = 0; j < 16; ++j) {
            F lo, hi;
            Isa::u4(q + (u * 16 + j) * kBlock + c, lo, hi);
            Isa::store(out + (u * 32 + j) * ld + c, Isa::fma(lo, s, m));
            Isa::store(out + (u * 32 + 16 + j) * ld + c, Isa::fma(hi, s, m));
          }
        }
      }
    }
  }
}

}  // namespace

QuantWeight pack_quant_weight(const at::Tensor& qweight, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& mins, int64_t bits,
                              int64_t group_size) {
  TORCH_CHECK(bits == 8 || bits == 4, "pack_quant_weight: bits must be 8 or 4, got ", bits);
  const auto want = bits == 8 ? at::kChar : at::kByte;
  TORCH_CHECK(qweight.device().is_cpu() && qweight.dim() == 2 && qweight.scalar_type() == want,
              "pack_quant_weight: qweight must be a CPU ",
              bits == 8 ? "int8 [N, K]" : "uint8 [N, K / 2]", " tensor for bits ", bits,
              ", got ", qweight.scalar_type(), " ", qweight.sizes());
  const int64_t n = qweight.size(0), k = qweight.size(1) * (bits == 8 ? 1 : 2);
  TORCH_CHECK(group_size > 0 && k % group_size == 0,
              "pack_quant_weight: group_size (", group_size, ") must divide K (", k, ")");
  TORCH_CHECK(bits == 8 || group_size % 32 == 0,
              "pack_quant_weight: group_size must be a multiple of 32 for bits 4, got ",
              group_size);
  const int64_t groups = k / group_size;
  const auto check_per_group = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 &&
                    t.size(0) == n && t.size(1) == groups,
                "pack_quant_weight: ", name, " must be float32 [N, K / group_size] = [", n,
                ", ", groups, "], got ", t.scalar_type(), " ", t.sizes());
  };
  check_per_group(scales, "scales");
  if (mins.has_value()) check_per_group(*mins, "mins");

  QuantWeight w;
  w.n = n;
  w.k = k;
  w.bits = bits;
  w.group_size = group_size;
  w.has_mins = mins.has_value();
  const int64_t blocks = w.blocks(), block_bytes = w.block_bytes(),
                group_bytes = w.group_bytes(), header = w.header_bytes();
  w.data = at::zeros({blocks, block_bytes}, qweight.options().dtype(at::kByte));
  const at::Tensor q = qweight.contiguous(), s = scales.contiguous();
  const at::Tensor m = mins.has_value() ? mins->contiguous() : at::Tensor();
  const uint8_t* qd = reinterpret_cast<const uint8_t*>(q.const_data_ptr());
  const float* sd = s.const_data_ptr<float>();
  const float* md = m.defined() ? m.const_data_ptr<float>() : nullptr;
  uint8_t* out = w.data.data_ptr<uint8_t>();
  const int64_t row_bytes = q.size(1);                       // canonical bytes a column
  const int64_t group_q_bytes = group_size * bits / 8;       // of one column's group
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      for (int64_t c = 0; c < kBlock && blk * kBlock + c < n; ++c) {
        const int64_t col = blk * kBlock + c;
        for (int64_t grp = 0; grp < groups; ++grp) {
          uint8_t* dst = out + blk * block_bytes + grp * group_bytes;
          std::memcpy(dst + c * 4, sd + col * groups + grp, 4);
          if (md != nullptr) std::memcpy(dst + (kBlock + c) * 4, md + col * groups + grp, 4);
          const uint8_t* src = qd + col * row_bytes + grp * group_q_bytes;
          for (int64_t i = 0; i < group_q_bytes; ++i) dst[header + i * kBlock + c] = src[i];
        }
      }
    }
  });
  return w;
}

at::Tensor dequantize_rows(const QuantWeight& w, int64_t n0, int64_t n1, at::ScalarType dtype) {
  TORCH_CHECK(0 <= n0 && n0 <= n1 && n1 <= w.n, "dequantize_rows: rows [n0, n1) = [", n0, ", ",
              n1, ") must lie in [0, N = ", w.n, "]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "dequantize_rows: dtype must be float32 or bfloat16, got ", dtype);
  // Written transposed, [K][whole blocks' columns], where a block's 16 columns of one k are
  // one store; returned as the [n1 - n0, K] view of it (what F.linear multiplies by as it is).
  const int64_t b0 = n0 / kBlock, b1 = (n1 + kBlock - 1) / kBlock, ld = (b1 - b0) * kBlock;
  at::Tensor wt = at::empty({w.k, ld}, w.data.options().dtype(at::kFloat));
  float* wd = wt.data_ptr<float>();
  auto* fill = w.bits == 8 ? (w.has_mins ? dequantize_block<8, true> : dequantize_block<8, false>)
                           : (w.has_mins ? dequantize_block<4, true> : dequantize_block<4, false>);
  at::parallel_for(b0, b1, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) fill(w, blk, wd + (blk - b0) * kBlock, ld);
  });
  if (dtype != at::kFloat) wt = wt.to(dtype);
  return wt.narrow(1, n0 - b0 * kBlock, n1 - n0).t();
}

}  // namespace carpool_gemm
