// The quantized weight's packing (canonical form -> QuantWeight, once at load) and its
// dequantization back to float rows (dequantize_rows: what calls of many rows multiply by
// with oneDNN). The layout is described in quant_weight.h; the kernel reading it in quant_gemm.cpp.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/equal.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gemm/quant_isa.h"
#include "gemm/quant_weight.h"

namespace carpool_gemm {

namespace {

using F = Isa::F;
constexpr int64_t kBlock = QuantWeight::kBlock;
constexpr int kVecs = kBlock / Isa::kLanes;
constexpr int64_t kUnit4 = 256;  // bytes of 32 k x 16 columns at 4 bits (quant_weight.h)
constexpr int64_t kUnit5 = 320;  // and at 5 bits

// float32 as bfloat16, rounded to nearest even (as Tensor.to rounds; weights are finite).
inline uint16_t bf16_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
inline void put(float* out, float v) { *out = v; }
inline void put(uint16_t* out, float v) { *out = bf16_bits(v); }

// Rows [c0, c1) of block `blk` (columns of W: c0 <= c < c1 <= 16) into out (row c0's k = 0,
// rows k elements apart): each 16 columns of one k one fused multiply-add of q by the group's
// scale and min, into a 32 x 16 tile, which is then copied out row by row.
template <int Bits, bool Mins, typename Out>
void dequantize_block(const QuantWeight& w, int64_t blk, int64_t c0, int64_t c1, Out* out) {
  const int64_t g = w.group_size, header = w.header_bytes();
  const uint8_t* block = w.data.const_data_ptr<uint8_t>() + blk * w.block_bytes();
  alignas(64) float tile[32][kBlock];
  for (int64_t grp = 0; grp < w.groups(); ++grp) {
    const uint8_t* group = block + grp * w.group_bytes();
    const uint8_t* q = group + header;
    F s[kVecs], m[kVecs];
    for (int h = 0; h < kVecs; ++h) {
      s[h] = header_load(group, h * Isa::kLanes, w.f16_header);
      m[h] = Mins ? header_load(group, kBlock + h * Isa::kLanes, w.f16_header) : Isa::zero();
    }
    for (int64_t k0 = 0; k0 < g; k0 += 32) {  // 32 k at a time (a 4-bit unit)
      const int64_t count = std::min<int64_t>(32, g - k0);
      for (int h = 0; h < kVecs; ++h) {
        const int64_t c = h * Isa::kLanes;
        if constexpr (Bits == 8) {
          for (int64_t i = 0; i < count; ++i)
            Isa::store(tile[i] + c, Isa::fma(Isa::i8(q + (k0 + i) * kBlock + c), s[h], m[h]));
        } else if constexpr (Bits == 6) {
          for (int64_t i = 0; i < count; i += 2) {
            F lo, hi;
            Isa::i8_pair(q, (k0 + i) / 2, c, lo, hi);
            Isa::store(tile[i] + c, Isa::fma(lo, s[h], m[h]));
            Isa::store(tile[i + 1] + c, Isa::fma(hi, s[h], m[h]));
          }
        } else {
          const uint8_t* unit = q + (k0 / 32) * (Bits == 5 ? kUnit5 : kUnit4);
          for (int64_t j = 0; j < 16; ++j) {
            F lo, hi;
            if constexpr (Bits == 5) {
              Isa::u5(unit, j, c, lo, hi);
            } else {
              Isa::u4(unit, j, c, lo, hi);
            }
            Isa::store(tile[j] + c, Isa::fma(lo, s[h], m[h]));
            Isa::store(tile[16 + j] + c, Isa::fma(hi, s[h], m[h]));
          }
        }
      }
      for (int64_t c = c0; c < c1; ++c) {
        Out* row = out + (c - c0) * w.k + grp * g + k0;
        for (int64_t i = 0; i < count; ++i) put(row + i, tile[i][c]);
      }
    }
  }
}

template <typename Out>
void dequantize_into(const QuantWeight& w, int64_t n0, int64_t n1, Out* out) {
  auto* fill = w.bits == 8   ? (w.has_mins ? dequantize_block<8, true, Out>
                                           : dequantize_block<8, false, Out>)
               : w.bits == 6 ? (w.has_mins ? dequantize_block<6, true, Out>
                                           : dequantize_block<6, false, Out>)
               : w.bits == 5 ? (w.has_mins ? dequantize_block<5, true, Out>
                                           : dequantize_block<5, false, Out>)
                             : (w.has_mins ? dequantize_block<4, true, Out>
                                           : dequantize_block<4, false, Out>);
  at::parallel_for(n0 / kBlock, (n1 + kBlock - 1) / kBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t first = std::max(n0, blk * kBlock), last = std::min(n1, (blk + 1) * kBlock);
      fill(w, blk, first - blk * kBlock, last - blk * kBlock, out + (first - n0) * w.k);
    }
  });
}

// Header element i (scales 0..15, mins 16..31) of a group starting at dst.
void put_header(uint8_t* dst, int64_t i, float v, bool f16) {
  if (f16) {
    const uint16_t half = c10::Half(v).x;
    std::memcpy(dst + i * 2, &half, 2);
  } else {
    std::memcpy(dst + i * 4, &v, 4);
  }
}

// Bits 4i.. (low) and 16 + 4i.. (high) of column c's dword in chunk j / 4 of a unit, i = j % 4
// (quant_weight.h): the nibbles of the unit's pair j.
void put_pair(uint8_t* unit, int64_t j, int64_t c, int lo, int hi) {
  uint8_t* at = unit + (j >> 2) * 64 + c * 4;
  uint32_t d;
  std::memcpy(&d, at, 4);
  d |= static_cast<uint32_t>(lo & 15) << (4 * (j & 3));
  d |= static_cast<uint32_t>(hi & 15) << (16 + 4 * (j & 3));
  std::memcpy(at, &d, 4);
}

// Column c's g / 2 canonical 4-bit bytes of one group into its units at `dst`.
void pack_group4(const uint8_t* src, int64_t g, int64_t c, uint8_t* dst) {
  for (int64_t i = 0; i < g / 2; ++i)
    put_pair(dst + (i / 16) * kUnit4, i % 16, c, src[i] & 15, src[i] >> 4);
}

// Column c's g q (-16..15) of one group into its 5-bit units at `dst` (quant_weight.h): u =
// q + 16 of pairs 0..14 as five-bit fields of the chunks' dwords, pair 15's bits spread over
// the five dwords' spare bits 15 and 31.
void pack_group5(const int8_t* q, int64_t g, int64_t c, uint8_t* dst) {
  for (int64_t k0 = 0; k0 < g; k0 += 32) {
    uint8_t* unit = dst + (k0 / 32) * kUnit5;
    const auto u = [&](int64_t k) { return static_cast<uint32_t>(q[k0 + k] + 16); };  // k < 32
    const auto put = [&](int chunk, uint32_t bits) {
      uint8_t* at = unit + chunk * 64 + c * 4;
      uint32_t d;
      std::memcpy(&d, at, 4);
      d |= bits;
      std::memcpy(at, &d, 4);
    };
    for (int64_t j = 0; j < kPairsIn5Fields; ++j)
      put(pair5_chunk(j), (u(j) << pair5_shift(j)) | (u(16 + j) << (16 + pair5_shift(j))));
    for (int i = 0; i < 5; ++i)
      put(i, (((u(15) >> i) & 1) << 15) | (((u(31) >> i) & 1) << 31));
  }
}

}  // namespace

QuantWeight pack_quant_weight(const at::Tensor& qweight, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& mins, int64_t bits,
                              int64_t group_size, bool f16_header) {
  TORCH_CHECK(bits == 8 || bits == 6 || bits == 5 || bits == 4,
              "pack_quant_weight: bits must be 8, 6, 5 or 4, got ", bits);
  const bool int8 = bits != 4;  // bits 5 and 6 pack an int8 canonical q in -16..15, -32..31
  const auto want = int8 ? at::kChar : at::kByte;
  TORCH_CHECK(qweight.device().is_cpu() && qweight.dim() == 2 && qweight.scalar_type() == want,
              "pack_quant_weight: qweight must be a CPU ",
              int8 ? "int8 [N, K]" : "uint8 [N, K / 2]", " tensor for bits ", bits,
              ", got ", qweight.scalar_type(), " ", qweight.sizes());
  const int64_t n = qweight.size(0), k = qweight.size(1) * (int8 ? 1 : 2);
  TORCH_CHECK(group_size > 0 && k % group_size == 0,
              "pack_quant_weight: group_size (", group_size, ") must divide K (", k, ")");
  TORCH_CHECK(bits == 8 || bits == 6 || group_size % 32 == 0,
              "pack_quant_weight: group_size must be a multiple of 32 for bits ", bits, ", got ",
              group_size);
  TORCH_CHECK(bits != 5 || qweight.numel() == 0 ||
                  (qweight.min().item<int8_t>() >= -16 && qweight.max().item<int8_t>() <= 15),
              "pack_quant_weight: bits 5 takes q in -16..15 only");
  TORCH_CHECK(bits != 6 || qweight.numel() == 0 ||
                  (qweight.min().item<int8_t>() >= -32 && qweight.max().item<int8_t>() <= 31),
              "pack_quant_weight: bits 6 takes q in -32..31 only");
  TORCH_CHECK(bits != 6 || group_size % 2 == 0,
              "pack_quant_weight: group_size must be even for bits 6, got ", group_size);
  const int64_t groups = k / group_size;
  const auto check_per_group = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 &&
                    t.size(0) == n && t.size(1) == groups,
                "pack_quant_weight: ", name, " must be float32 [N, K / group_size] = [", n,
                ", ", groups, "], got ", t.scalar_type(), " ", t.sizes());
  };
  check_per_group(scales, "scales");
  if (mins.has_value()) check_per_group(*mins, "mins");
  const auto exact_in_f16 = [](const at::Tensor& t) {
    return at::equal(t.to(at::kHalf).to(at::kFloat), t);
  };
  TORCH_CHECK(!f16_header || (exact_in_f16(scales) && (!mins.has_value() || exact_in_f16(*mins))),
              "pack_quant_weight: f16_header needs every scale and min exact in float16");

  QuantWeight w;
  w.n = n;
  w.k = k;
  w.bits = bits;
  w.group_size = group_size;
  w.has_mins = mins.has_value();
  w.f16_header = f16_header;
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
  const int64_t group_q_bytes = group_size * (int8 ? 8 : 4) / 8;  // of one column's group
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      for (int64_t c = 0; c < kBlock && blk * kBlock + c < n; ++c) {
        const int64_t col = blk * kBlock + c;
        for (int64_t grp = 0; grp < groups; ++grp) {
          uint8_t* dst = out + blk * block_bytes + grp * group_bytes;
          put_header(dst, c, sd[col * groups + grp], f16_header);
          if (md != nullptr) put_header(dst, kBlock + c, md[col * groups + grp], f16_header);
          const uint8_t* src = qd + col * row_bytes + grp * group_q_bytes;
          if (bits == 5) {
            pack_group5(reinterpret_cast<const int8_t*>(src), group_size, c, dst + header);
            continue;
          }
          if (bits == 4) {
            pack_group4(src, group_size, c, dst + header);
            continue;
          }
          if (bits == 6) {  // byte 2c + e of pair p: q[k0 + 2p + e]
            for (int64_t i = 0; i < group_q_bytes; ++i)
              dst[header + (i / 2) * 32 + 2 * c + (i % 2)] = src[i];
            continue;
          }
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
  TORCH_CHECK(!w.w8a8, "dequantize_rows: a W8A8 weight (pack_w8a8_weight) multiplies by "
              "w8a8_linear only");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "dequantize_rows: dtype must be float32 or bfloat16, got ", dtype);
  at::Tensor out = at::empty({n1 - n0, w.k}, w.data.options().dtype(dtype));
  if (dtype == at::kFloat) {
    dequantize_into(w, n0, n1, out.data_ptr<float>());
  } else {
    dequantize_into(w, n0, n1, reinterpret_cast<uint16_t*>(out.data_ptr()));
  }
  return out;
}

}  // namespace carpool_gemm
