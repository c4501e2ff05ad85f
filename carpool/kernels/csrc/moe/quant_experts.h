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
// quant_linear up to its cut (the part's max_rows, which the platform's QuantRoute decides),
// above it the weight dequantized into at::linear.
struct QuantExperts {
  using Parts = std::vector<std::vector<carpool_gemm::QuantWeight>>;  // [E][parts]
  using Cuts = std::vector<std::vector<int64_t>>;                     // [E][parts]
  Parts gate_up, down;
  Cuts gate_up_rows, down_rows;  // each part's cut
  int64_t hidden = 0, inner = 0, rounded_from = 0;

  QuantExperts(Parts gate_up, Parts down, Cuts gate_up_rows, Cuts down_rows,
               int64_t rounded_from);
  int64_t experts() const { return static_cast<int64_t>(gate_up.size()); }
};

// sum over each row's experts e (ascending) of weights * down_e(silu(gate_e(x)) * up_e(x)):
// x [T, H] float32 or bfloat16, ids [T, k] int64, weights [T, k] -> [T, H] in x's dtype,
// the bits of the per-expert loop over QuantLinear modules (models/moe.py's experts_loop).
at::Tensor quant_moe_experts(const at::Tensor& x, const QuantExperts& experts,
                             const at::Tensor& ids, const at::Tensor& weights);

}  // namespace carpool_moe
