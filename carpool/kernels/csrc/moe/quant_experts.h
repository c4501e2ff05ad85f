// A mixture of experts' experts kept quantized (models/quant/experts.py's QuantExperts), as
// one call a layer: quant_moe_experts (quant_experts.cpp). The layer stack's MoeStep holds
// them (layers/layer_stack.h), the bindings give them to Python (platform/cpu_moe.py).

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "gemm/quant_weight.h"

namespace carpool_moe {

// Every expert's gate/up (its parts stacked by output rows, as QuantLinear stacks them:
// gate's I rows then up's, one part where both are one type) and its down, each part packed
// by pack_quant_weight; each part multiplied as cpu_quant's part_matmul multiplies it:
// quant_linear up to its cut (int8_max_rows for bits 8 and 6, a byte a weight; int4_max_rows
// for 4 and 5, as QuantRoute.max_rows), above it the weight dequantized into at::linear.
struct QuantExperts {
  std::vector<std::vector<carpool_gemm::QuantWeight>> gate_up, down;  // [E][parts]
  int64_t hidden = 0, inner = 0;
  int64_t int8_max_rows = 0, int4_max_rows = 0, rounded_from = 0;

  QuantExperts(std::vector<std::vector<carpool_gemm::QuantWeight>> gate_up,
               std::vector<std::vector<carpool_gemm::QuantWeight>> down, int64_t int8_max_rows,
               int64_t int4_max_rows, int64_t rounded_from);
  int64_t experts() const { return static_cast<int64_t>(gate_up.size()); }
  int64_t max_rows(const carpool_gemm::QuantWeight& w) const {
    return w.bits == 8 || w.bits == 6 ? int8_max_rows : int4_max_rows;
  }
};

// sum over each row's experts e (ascending) of weights * down_e(silu(gate_e(x)) * up_e(x)):
// x [T, H] float32 or bfloat16, ids [T, k] int64, weights [T, k] -> [T, H] in x's dtype,
// the bits of the per-expert loop over QuantLinear modules (models/moe.py's experts_loop).
at::Tensor quant_moe_experts(const at::Tensor& x, const QuantExperts& experts,
                             const at::Tensor& ids, const at::Tensor& weights);

}  // namespace carpool_moe
