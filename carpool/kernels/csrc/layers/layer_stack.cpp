// A model's decoder layers in one call.
//
// The layers of models/llama.py, as the CPU platform prepares them (packed linears, the fused
// norm, RoPE and SiLU x up, the kernels attention backend), call one kernel after another from
// Python: about 16 module and tensor calls a layer, each paid with the caches cold from the
// kernel before it, which at decode sizes is a large share of the step
// (docs/lab/47-the-decoder-layers-in-one-c-call.md). Here the same kernels run in the same
// order on the same tensors, attention through the one entry the Python backend calls too
// (attention/attend.h), so the hidden states are the modules' to the bit
// (tests/runner/test_layer_stack.py), with the GIL released for the whole stack except a
// linear's calls of more rows than its small GEMM takes, which go to the module's own forward
// (prompt-sized steps, where they are oneDNN's and the Python around them is a small share).
// platform/cpu_layer_stack.py builds it where the route (platform/cpu_route.py) says the
// stack runs the layers.

#include "layers/layer_stack.h"

#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <c10/util/Exception.h>

#include <utility>

#include "attention/attend.h"
#include "kernel_api.h"

namespace carpool_layers {

namespace {

at::Tensor multiply(const StackLinear& linear, const at::Tensor& x) {
  if (x.size(0) > linear.max_rows) return linear.forward(x);
  if (!linear.quant.empty()) {
    const at::Tensor rows =
        linear.int8_input ? carpool_fused::int8_per_token(x.contiguous()) : x.contiguous();
    std::vector<at::Tensor> outs;
    for (const carpool_gemm::QuantWeight& part : linear.quant)
      outs.push_back(carpool_gemm::quant_linear(rows, part, c10::nullopt, linear.rounded_from));
    at::Tensor y = outs.size() == 1 ? outs[0] : at::cat(outs, 1);
    if (linear.bias.has_value()) y = at::add(y, linear.bias->to(y.scalar_type()));
    return y;
  }
  if (linear.f32) return carpool_gemm::small_gemm_f32(x, linear.packed, linear.out_features,
                                                      linear.bias);
  return carpool_gemm::small_gemm_bf16(x, linear.packed, linear.out_features, linear.bias,
                                       linear.amx);
}

// The linear's output with its LoRA term added (Python: `StepLora.add` after the linear).
at::Tensor with_lora(at::Tensor out, const at::Tensor& x, const LoraTerm* term) {
  if (term != nullptr && !term->starts.empty())
    carpool_gemm::lora_add_(out, x, term->starts, term->ends, term->a, term->b, term->parts);
  return out;
}

// SparseMoeBlock.forward on one rank (no shared expert): router, route, experts.
at::Tensor sparse_mlp(const MoeStep& moe, const at::Tensor& h) {
  if (!moe.gate_up.defined() && moe.quant == nullptr) return moe.forward(h);
  auto [weights, ids] = carpool_moe::moe_route(multiply(moe.router, h), moe.top_k,
                                               moe.renormalize);
  if (moe.round_weights) weights = weights.to(h.scalar_type());
  if (moe.quant != nullptr) return carpool_moe::quant_moe_experts(h, *moe.quant, ids, weights);
  return carpool_moe::moe_experts(h, moe.gate_up, moe.down, ids, weights);
}

}  // namespace

LayerStack::LayerStack(std::vector<DecoderWeights> layers, StackShape shape)
    : layers_(std::move(layers)), shape_(shape) {
  TORCH_CHECK(!layers_.empty(), "LayerStack: no layers");
  TORCH_CHECK(shape_.num_heads > 0 && shape_.num_kv_heads > 0 && shape_.head_dim > 0 &&
                  shape_.num_heads % shape_.num_kv_heads == 0,
              "LayerStack: heads must be positive, query heads a multiple of kv heads");
  for (const DecoderWeights& layer : layers_) {
    TORCH_CHECK(layer.q_norm.has_value() == layer.k_norm.has_value(),
                "LayerStack: a layer has both q and k norms or neither");
    has_moe_ = has_moe_ || layer.moe.has_value();
  }
}

at::Tensor LayerStack::attention(const DecoderWeights& layer, const at::Tensor& h,
                                 const at::Tensor& cos, const at::Tensor& sin,
                                 const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                                 const std::vector<at::Tensor>& paged_rows,
                                 const std::vector<at::Tensor>& prefill_rows,
                                 AttentionSwitches switches, const LoraTerm* lora) const {
  const int64_t tokens = h.size(0), heads = shape_.num_heads, kv_heads = shape_.num_kv_heads;
  const int64_t d = shape_.head_dim;
  // Attention.forward: the q, k, v views of one projection, the q and k norms, RoPE in place.
  const std::vector<at::Tensor> qkv =
      with_lora(multiply(layer.qkv, h), h, lora)
          .split_with_sizes({heads * d, kv_heads * d, kv_heads * d}, -1);
  at::Tensor q = qkv[0].view({tokens, heads, d});
  at::Tensor k = qkv[1].view({tokens, kv_heads, d});
  const at::Tensor v = qkv[2].view({tokens, kv_heads, d});
  if (layer.q_norm.has_value()) {
    q = std::get<0>(carpool_fused::rms_norm(q, c10::nullopt, *layer.q_norm, shape_.eps));
    k = std::get<0>(carpool_fused::rms_norm(k, c10::nullopt, *layer.k_norm, shape_.eps));
  }
  carpool_fused::rotary_(q, k, cos, sin);
  // CpuKernelBackend.forward: the KV write, then the one attention entry both of them call.
  at::Tensor cache = kv_cache;
  carpool_fused::write_kv_(cache, slot_mapping, k, v);
  const at::Tensor out =
      carpool_attention::attend(q, kv_cache, paged_rows, prefill_rows, shape_.scale,
                                switches.sliding_window, switches.prefill_amx,
                                switches.batch_invariant);
  const at::Tensor flat = out.reshape({tokens, heads * d});
  return with_lora(multiply(layer.o, flat), flat, lora == nullptr ? nullptr : lora + 1);
}

at::Tensor LayerStack::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                               const std::vector<at::Tensor>& kv_caches,
                               const at::Tensor& slot_mapping,
                               const std::vector<at::Tensor>& paged_rows,
                               const std::vector<at::Tensor>& prefill_rows,
                               AttentionSwitches switches,
                               const std::vector<LoraTerm>& lora) const {
  TORCH_CHECK(lora.empty() || lora.size() == 4 * layers_.size(), "LayerStack: ",
              lora.size(), " LoRA terms, not four a layer");
  TORCH_CHECK(lora.empty() || !has_moe_, "LayerStack: no LoRA terms on a mixture of experts");
  TORCH_CHECK(kv_caches.size() == layers_.size(), "LayerStack: ", layers_.size(),
              " layers but ", kv_caches.size(), " caches");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "LayerStack: x must be a contiguous [T, hidden]");
  // DecoderLayer.forward: (x, residual) -> (the MLP's output, the residual stream before it).
  at::Tensor hidden = x, residual;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecoderWeights& layer = layers_[i];
    at::Tensor h;
    if (!residual.defined()) {
      residual = hidden;
      h = std::get<0>(carpool_fused::rms_norm(hidden, c10::nullopt, layer.input_norm,
                                              shape_.eps));
    } else {
      std::tie(h, residual) = carpool_fused::rms_norm(hidden, residual, layer.input_norm,
                                                      shape_.eps);
    }
    const LoraTerm* terms = lora.empty() ? nullptr : lora.data() + 4 * i;
    h = attention(layer, h, cos, sin, kv_caches[i], slot_mapping, paged_rows, prefill_rows,
                  switches, terms);
    std::tie(h, residual) = carpool_fused::rms_norm(h, residual, layer.post_attention_norm,
                                                    shape_.eps);
    if (layer.moe.has_value()) {
      hidden = sparse_mlp(*layer.moe, h);
      continue;
    }
    const at::Tensor inner = carpool_fused::silu_and_mul(
        with_lora(multiply(layer.gate_up, h), h, terms == nullptr ? nullptr : terms + 2));
    hidden = with_lora(multiply(layer.down, inner), inner,
                       terms == nullptr ? nullptr : terms + 3);
  }
  return at::add(residual, hidden);
}

}  // namespace carpool_layers
