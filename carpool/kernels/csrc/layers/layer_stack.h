// A model's decoder layers run in one call: the kernels each layer's modules would call, in
// the same order on the same tensors, without the Python around them (layer_stack.cpp).

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "gemm/quant_weight.h"
#include "moe/quant_experts.h"

namespace carpool_layers {

// One linear layer: calls of up to max_rows rows by its small GEMM (the packed weight, the
// output width, the bias), larger ones by `forward`, the layer's own (the Python module's
// forward, which takes the GIL: oneDNN's calls, whose row counts it buckets). A quantized
// layer (`quant` not empty) multiplies by quant_linear on each stacked part instead, their
// outputs side by side, then adds the bias: what its QuantLinear module computes (with its
// input rounded per row by int8_per_token first where the parts take W8A8's int8 input;
// W8A8 parts packed by pack_w8a8_weight take x as it is: quant_linear rounds it itself).
struct StackLinear {
  at::Tensor packed;
  int64_t out_features = 0;
  c10::optional<at::Tensor> bias;
  bool f32 = false;  // small_gemm_f32 (else small_gemm_bf16)
  bool amx = false;  // small_gemm_bf16 on AMX tiles
  int64_t max_rows = 0;
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::vector<carpool_gemm::QuantWeight> quant;
  int64_t rounded_from = 0;  // quant_linear's
  bool int8_input = false;   // x rounded to int8 steps per row first (W8A8: int8_per_token)
};

// A sparse layer's MLP (a mixture of experts), as models/moe.py's SparseMoeBlock runs it on
// the CPU: the router's linear, moe_route, the weights cast to the hidden states' dtype where
// the model casts them (`round_weights`), moe_experts on the packed experts, or
// quant_moe_experts on quantized ones (`quant`). Experts neither takes leave both unset and
// give `forward`, the block's own (the Python module's, which takes the GIL), for the whole
// MLP.
struct MoeStep {
  StackLinear router;
  at::Tensor gate_up, down;  // pack_moe_experts'
  int64_t top_k = 0;
  bool renormalize = false, round_weights = false;
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::shared_ptr<const carpool_moe::QuantExperts> quant;
};

// One decoder layer: its two norms' weights, the q and k norms' (Qwen3) or none, and its four
// linears; a sparse layer has `moe` instead of gate_up and down (left empty).
struct DecoderWeights {
  at::Tensor input_norm, post_attention_norm;
  c10::optional<at::Tensor> q_norm, k_norm;
  StackLinear qkv, o, gate_up, down;
  c10::optional<MoeStep> moe;
};

// The attention shape and the norms' epsilon, the same in every layer.
// One linear's LoRA adapters' terms in a step, as lora_add_ takes them (no starts: none).
struct LoraTerm {
  std::vector<int64_t> starts, ends;
  std::vector<at::Tensor> a, b;
  std::vector<int64_t> parts;
};

struct StackShape {
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  double eps = 0, scale = 0;
};

// The route's attention switches: `attend`'s arguments that are not the step's rows.
struct AttentionSwitches {
  int64_t sliding_window = 0;  // 0: none
  bool prefill_amx = false;    // prefill_attention_bf16 on AMX tiles
  bool batch_invariant = false;  // every row scored the same way, whatever the step
};

class LayerStack {
 public:
  LayerStack(std::vector<DecoderWeights> layers, StackShape shape);

  // x [T, hidden] (the embedded tokens), cos and sin [T, head_dim] contiguous, one cache per
  // layer; the rows paged_attention attends and those prefill_attention_bf16 attends, as
  // `attend` takes them (each the four int32 tensors of the backend's KernelRows: block
  // tables, query starts, query lens, seq lens; empty where the step has none). Returns the last layer's output plus its
  // residual stream (the hidden states before the final norm). `lora`: none, or four terms a
  // layer (qkv, o, gate_up, down), each added after its linear as the modules add them.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                     const std::vector<at::Tensor>& paged_rows,
                     const std::vector<at::Tensor>& prefill_rows,
                     AttentionSwitches switches, const std::vector<LoraTerm>& lora) const;

 private:
  at::Tensor attention(const DecoderWeights& layer, const at::Tensor& h, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping, const std::vector<at::Tensor>& paged_rows,
                       const std::vector<at::Tensor>& prefill_rows,
                       AttentionSwitches switches, const LoraTerm* lora) const;

  std::vector<DecoderWeights> layers_;
  StackShape shape_;
  bool has_moe_ = false;
};

}  // namespace carpool_layers
