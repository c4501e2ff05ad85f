// The kernels' C++ entry points, one declaration each, for the files that call them across
// files: the Python bindings (bindings.cpp), the attention entry (attention/attend.h) and the
// layer stack (layer_stack.cpp).

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "gemm/quant_weight.h"

// paged_attention.cpp
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_starts,
                     const at::Tensor& query_lens, const at::Tensor& seq_lens, double scale,
                     int64_t sliding_window, bool batch_invariant, int64_t bf16_widen);

namespace carpool_gemm {  // small_gemm.cpp
bool has_bf16_gemm();
bool has_small_gemm_bf16();
at::Tensor pack_bf16_weight(const at::Tensor& weight);
at::Tensor small_gemm_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                           const c10::optional<at::Tensor>& bias, bool amx);
bool has_f32_gemm();
at::Tensor pack_f32_weight(const at::Tensor& weight);
at::Tensor small_gemm_f32(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                          const c10::optional<at::Tensor>& bias);
}

namespace carpool_gemm {  // quant_pack.cpp, quant_gemm.cpp
QuantWeight pack_quant_weight(const at::Tensor& qweight, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& mins, int64_t bits,
                              int64_t group_size, bool f16_header = false);
at::Tensor dequantize_rows(const QuantWeight& w, int64_t n0, int64_t n1, at::ScalarType dtype);
// rounded_from: bfloat16 calls of at least this many rows multiply by the weight rounded to
// bfloat16 (quant_bf16_rounded.h); 0: never (every row exact, the same bits in any batch).
at::Tensor quant_linear(const at::Tensor& x, const QuantWeight& w,
                        const c10::optional<at::Tensor>& bias, int64_t rounded_from = 0);
}

namespace carpool_gemm {  // w8a8_gemm.cpp
QuantWeight pack_w8a8_weight(const at::Tensor& qweight, const at::Tensor& scales);
// x rounded per token to int8 (int8_per_token's q and scales), times the int8 weight in int32,
// each output (sum q_x q_w) * scale_x * scale_w (+ bias) in float32, then x's dtype
at::Tensor w8a8_linear(const at::Tensor& x, const QuantWeight& w,
                       const c10::optional<at::Tensor>& bias);
}

namespace carpool_gemm {  // lora_gemm.cpp
void lora_add_(at::Tensor& out, const at::Tensor& x, const std::vector<int64_t>& starts,
               const std::vector<int64_t>& ends, const std::vector<at::Tensor>& a,
               const std::vector<at::Tensor>& b, const std::vector<int64_t>& parts);
}

namespace carpool_prefill {  // prefill_attention.cpp
bool prefill_head_dim_ok(int64_t head_dim);
void prefill_attention_bf16(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& query_starts,
                            const at::Tensor& query_lens, const at::Tensor& seq_lens,
                            double scale, bool amx);
}

namespace carpool_fused {  // fused_ops.cpp
void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x,
                                            const c10::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void write_kv_(at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& k,
               const at::Tensor& v);
at::Tensor int8_per_token(const at::Tensor& x);  // int8_rows.cpp
// int8_per_token's q of each row as q + 128 at out + r * out_stride (padded with 128 to
// out_stride), its scale at scales[r] (float32)
void int8_per_token_u8(const at::Tensor& x, uint8_t* out, int64_t out_stride, float* scales);
}

namespace carpool_moe {  // moe/moe_experts.cpp
std::tuple<at::Tensor, at::Tensor> pack_moe_experts(const at::Tensor& gate_up,
                                                    const at::Tensor& down);
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                       const at::Tensor& ids, const at::Tensor& weights);
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k,
                                             bool renormalize);  // moe/moe_route.cpp
}

namespace carpool_greedy {  // greedy.cpp
at::Tensor argmax_rows(const at::Tensor& logits);
}

namespace carpool_threads {  // threads.cpp
std::vector<int64_t> bind_threads(const std::vector<int64_t>& cpus);
}
