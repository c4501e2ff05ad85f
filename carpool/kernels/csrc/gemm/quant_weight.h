// A quantized linear weight packed once at load (quant_pack.cpp) for the quantized GEMM
// (quant_gemm.cpp): the layout both files and the bindings share.
//
// It starts from carpool's canonical quantized weight (what every loader converts GGUF, AWQ,
// GPTQ and compressed-tensors weights to; carpool/quant/): W [N, K] as
//   bits 8: qweight int8 [N, K], q = qweight[n, k] (-128..127);
//   bits 4: qweight uint8 [N, K / 2], q in 0..15, in units of 32 consecutive k (k0 = 32 u):
//           byte 16 u + j holds q[n, k0 + j] in its low nibble, q[n, k0 + 16 + j] in its high
//           one (ggml's Q4_0 order);
//   scales float32 [N, K / g], mins float32 [N, K / g] or none (0), g = group_size, K % g == 0
//   (bits 4: g % 32 == 0);
//   W[n, k] = scales[n, k / g] * q[n, k] + mins[n, k / g]   (float32).
//
// Packed (`data`, uint8 [blocks, block_bytes], blocks = ceil(N / 16)): blocks of 16 output
// columns (N padded with zero columns), each block a run of its K / g groups, each group
//   scales[16] float32, mins[16] float32 (only with mins), then the group's q (float16
//   scales and mins instead where every one is exact in float16, `f16_header`: GGUF's
//   Q8_0 / Q5_0 / Q4_0 store theirs so, and the header is then half the bytes):
//   bits 8: g x 16 bytes, byte [k][c] = q[column c][k0 + k];
//   bits 4: g / 32 units of 32 k (k0 = 32 u) x 16 columns, 256 bytes: 4 chunks of 16 dwords,
//           chunk j / 4's dword c holding q[c][k0 + j] in bits 4 (j % 4).., q[c][k0 + 16 + j]
//           in bits 16 + 4 (j % 4).. (the pair the readers take together, j < 16);
//   bits 5 (packed from bits-8 q in -16..15, e.g. GGUF's Q5_0, with g % 32 == 0): per 32 k,
//           a unit of 320 bytes, 5 chunks of 16 dwords of u = q + 16: pair j < 15 (u[c][k0 +
//           j], u[c][k0 + 16 + j]) in bits 5 (j % 3).. and 16 + 5 (j % 3).. of chunk j / 3's
//           dword c; pair 15's in the spare bits, chunk i's bit 15 (31) holding bit i of
//           u[c][k0 + 15] (u[c][k0 + 31]). Five bits a weight instead of eight.
//   bits 6 (packed from bits-8 q in -32..31, e.g. GGUF's Q6_K, with g even): still a byte a
//           weight, in pairs of k: g / 2 x 32 bytes, byte 2c + e of pair p = q[c][k0 + 2p + e]
//           (each column's pair one word of two bytes: widened to words, one 64-entry
//           `vpermt2w` lookup gives the pair as bfloat16, where bits 8 widen and convert
//           twice). The same sums as bits 8, in the same order.
// So a block streams front to back once: 16 columns' q for one k are one 16-byte load (bits
// 8); one 64-byte load and one shift give 16 columns' pair j, each in a dword's two halves
// (bits 4), or the five bits `vpermw` indexes by (bits 5, but for pair 15's five loads). A group's scales and mins sit in the cache line before its q. Its size is the
// canonical bytes plus the padding of N.
//
// W8A8 (`w8a8`, pack_w8a8_weight in w8a8_gemm.cpp): an int8 weight with one scale per column
// (compressed-tensors' per-channel int8) multiplied int8 x int8 by rows rounded per token.
// `data` is uint8 [blocks, kp * 16], kp = K rounded up to 4 (zeros after K): per 4 k (a quad)
// 64 bytes, column c's q[k0..k0 + 3] in bytes 4c..4c + 3 (one dword a column, the operand
// `vpdpbusd` sums 4 products of); `col_scales` float32 and `col_sums` int32 [blocks * 16]:
// each column's scale and 128 * sum_k q (what activations shifted by 128 to unsigned add).

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace carpool_gemm {

struct QuantWeight {
  at::Tensor data;  // uint8 [blocks, block_bytes]
  int64_t n = 0, k = 0, bits = 8, group_size = 0;
  bool has_mins = false;
  bool f16_header = false;  // the groups' scales and mins as float16
  bool w8a8 = false;         // the W8A8 layout above (w8a8_gemm.cpp), not the groups'
  at::Tensor col_scales, col_sums;  // W8A8 only

  static constexpr int64_t kBlock = 16;  // output columns per block
  int64_t blocks() const { return (n + kBlock - 1) / kBlock; }
  int64_t groups() const { return k / group_size; }
  int64_t header_bytes() const { return (has_mins ? 2 : 1) * kBlock * (f16_header ? 2 : 4); }
  int64_t group_bytes() const {
    return header_bytes() + group_size * kBlock * (bits == 6 ? 8 : bits) / 8;
  }
  int64_t block_bytes() const { return w8a8 ? kp() * kBlock : groups() * group_bytes(); }
  int64_t kp() const { return (k + 3) / 4 * 4; }  // W8A8's K padded to whole quads
};

}  // namespace carpool_gemm
