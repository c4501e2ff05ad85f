// The Python module: every kernel of csrc/ bound in one place, so each kernel file stays
// free of pybind. Kernels that run long release the GIL, like torch's own ops.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include "gemm/amx_tiles.h"
#include "attention/attend.h"
#include "attention/block_ops.h"
#include "kernel_api.h"
#include "layers/layer_stack.h"
#include "gemm/stealable_shares.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

namespace {
using Vec = at::vec::Vectorized<float>;
// How many threads one at::parallel_for spreads over (a build check: 1 without OpenMP).
int64_t parallel_width() {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    seen.fetch_or(uint64_t{1} << (at::get_thread_num() % 64));
  });
  return __builtin_popcountll(seen.load());
}

// The (unit, share) each StealableShares::next(owners[i]) returns, in order, over shares
// [bounds[s], bounds[s + 1]): the claim order a kernel's threads would see, run on one thread.
std::vector<std::tuple<int64_t, int64_t>> shares_claims(const std::vector<int64_t>& bounds,
                                                         const std::vector<int64_t>& owners) {
  const int64_t shares = static_cast<int64_t>(bounds.size()) - 1;
  TORCH_CHECK(shares >= 1 && bounds[0] == 0, "shares_claims: bounds must start at 0");
  for (int64_t s = 0; s < shares; ++s)
    TORCH_CHECK(bounds[s] <= bounds[s + 1], "shares_claims: bounds must not decrease");
  for (int64_t own : owners)
    TORCH_CHECK(own >= 0 && own < shares, "shares_claims: no share ", own);
  StealableShares split(shares, [&](int64_t s) { return bounds[s]; });
  std::vector<std::tuple<int64_t, int64_t>> claims;
  for (int64_t own : owners) {
    const auto claim = split.next(own);
    claims.emplace_back(claim.unit, claim.share);
  }
  return claims;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("max_head_dim", [] { return static_cast<int64_t>(carpool_cpu::kMaxVecs * Vec::size()); },
        "The largest head_dim paged_attention takes in this build (callers fall back above).");
  m.def("parallel_width", &parallel_width,
        "Threads one at::parallel_for runs on (1 means the build lost OpenMP).");
  m.def("bind_threads", &carpool_threads::bind_threads,
        "Pins torch's intra-op thread i to cpus[i] (one CPU per thread); returns the "
        "threads' kernel ids, in the same order.",
        py::arg("cpus"));
  m.def("shares_claims", &shares_claims,
        "(unit, share) of each claim by owners[i] of the stealable shares that start at "
        "bounds (the AMX GEMM's split of its work), made in that order; unit -1: none left.",
        py::arg("bounds"), py::arg("owners"));
  m.def("lora_add_", &carpool_gemm::lora_add_,
        "LoRA terms in place: out[starts[g]:ends[g]] gets (x·a[g])[:, r0:r1]·b[p] in columns "
        "[col0, col0 + b[p].size(1)) for each part p = (g, col0, r0, r1) of parts; float32 or "
        "bfloat16, float32 accumulation.",
        py::arg("out"), py::arg("x"), py::arg("starts"), py::arg("ends"), py::arg("a"),
        py::arg("b"), py::arg("parts"), py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &carpool_greedy::argmax_rows,
        "Each row's largest value's index, as max(-1).indices (first of equals, first NaN); "
        "float32 or bfloat16 [N, V] with contiguous rows.",
        py::arg("logits"), py::call_guard<py::gil_scoped_release>());
  m.def("rotary_", &carpool_fused::rotary_,
        "q [T, H, D] and k [T, Hkv, D] rotated in place by cos/sin [T, D] (apply_rope's bits).",
        py::arg("q"), py::arg("k"), py::arg("cos"), py::arg("sin"),
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &carpool_fused::rms_norm,
        "(x + residual or x) normalised, times weight; returns (out, x + residual or None). "
        "float32 rows give Hugging Face's eager ops' bits; bfloat16/float16 F.rms_norm's up "
        "to a last bit.",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &carpool_fused::silu_and_mul,
        "silu(gate) * up for gate_up = [gate | up] [T, 2I] -> [T, I]; float32, bfloat16 or float16.",
        py::arg("gate_up"), py::call_guard<py::gil_scoped_release>());
  m.def("write_kv_", &carpool_fused::write_kv_,
        "k, v [T, Hkv, D] stored at their slots of kv_cache [2, Hkv, blocks, block_size, D].",
        py::arg("kv_cache"), py::arg("slot_mapping"), py::arg("k"), py::arg("v"),
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_per_token", &carpool_fused::int8_per_token,
        "x [M, K] (float32 or bfloat16) with each row rounded to int8 steps of max|x| / 127.5 "
        "and scaled back (W8A8's dynamic per-token activations), in x's dtype: the eager "
        "int8_per_token's bits.",
        py::arg("x"), py::call_guard<py::gil_scoped_release>());
  m.def("pack_moe_experts", &carpool_moe::pack_moe_experts,
        "Every expert's gate_up [E, 2I, H] and down [E, H, I] (float32 or bfloat16) -> the "
        "(gate_up, down) layout moe_experts reads, I zero-padded to whole blocks.",
        py::arg("gate_up"), py::arg("down"));
  m.def("moe_experts", &carpool_moe::moe_experts,
        "sum over each row's experts of weight * down(silu(gate(x)) * up(x)) for x [T, H], "
        "packed weights (pack_moe_experts), ids [T, k] int64 and weights [T, k]; float32 "
        "sums, each row independent of the others.",
        py::arg("x"), py::arg("gate_up"), py::arg("down"), py::arg("ids"), py::arg("weights"),
        py::call_guard<py::gil_scoped_release>());
  m.def("moe_route", &carpool_moe::moe_route,
        "Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64): a float32 "
        "softmax per row, the top k (descending, the lower expert first on ties), "
        "renormalised to sum to 1 if renormalize.",
        py::arg("logits"), py::arg("top_k"), py::arg("renormalize"),
        py::call_guard<py::gil_scoped_release>());
  m.def("has_bf16_gemm", &carpool_gemm::has_bf16_gemm,
        "Whether this CPU runs small_gemm_bf16 (AVX512-BF16).");
  m.def("has_small_gemm_bf16", &carpool_gemm::has_small_gemm_bf16,
        "Whether this build and CPU run small_gemm_bf16 (AVX512-BF16, or AVX2 builds in "
        "float32 FMAs).");
  m.def("has_amx", &amx_usable,
        "Whether this build and CPU run AMX tiles: small_gemm_bf16 and "
        "prefill_attention_bf16 take amx=True.");
  m.def("pack_bf16_weight", &carpool_gemm::pack_bf16_weight,
        "weight [N, K] bfloat16 -> the layout small_gemm_bf16 reads.", py::arg("weight"));
  m.def("small_gemm_bf16", &carpool_gemm::small_gemm_bf16,
        "x [M, K] @ weight.T (+ bias) for a packed bfloat16 weight of n rows -> [M, n]; "
        "amx=True: on AMX tiles (K a multiple of 32).",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(),
        py::arg("amx") = false, py::call_guard<py::gil_scoped_release>());
  m.def("has_f32_gemm", &carpool_gemm::has_f32_gemm,
        "Whether this build runs small_gemm_f32 (AVX-512 or AVX2).");
  m.def("pack_f32_weight", &carpool_gemm::pack_f32_weight,
        "weight [N, K] float32 -> the layout small_gemm_f32 reads.", py::arg("weight"));
  m.def("small_gemm_f32", &carpool_gemm::small_gemm_f32,
        "x [M, K] @ weight.T (+ bias) for a packed float32 weight of n rows -> [M, n].",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  using carpool_gemm::QuantWeight;
  py::class_<QuantWeight>(m, "QuantWeight", py::module_local(),
                          "A quantized weight packed for quant_linear (pack_quant_weight).")
      .def_property_readonly("data", [](const QuantWeight& w) { return w.data; })
      .def_readonly("n", &QuantWeight::n)
      .def_readonly("k", &QuantWeight::k)
      .def_readonly("bits", &QuantWeight::bits)
      .def_readonly("group_size", &QuantWeight::group_size)
      .def_readonly("has_mins", &QuantWeight::has_mins)
      .def_readonly("f16_header", &QuantWeight::f16_header)
      .def_readonly("w8a8", &QuantWeight::w8a8)
      .def_property_readonly("nbytes", [](const QuantWeight& w) { return w.data.nbytes(); });
  m.def("pack_quant_weight", &carpool_gemm::pack_quant_weight,
        "The canonical quantized weight (qweight, scales, mins or None, bits 8 or 4, "
        "group_size; carpool/quant) packed once for quant_linear; bits 5 stores an int8 "
        "qweight whose values lie in -16..15 in five bits a weight; f16_header keeps scales "
        "and mins that are exact in float16 as float16.",
        py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bits"),
        py::arg("group_size"), py::arg("f16_header") = false);
  m.def("pack_w8a8_weight", &carpool_gemm::pack_w8a8_weight,
        "An int8 weight [N, K] with one float32 scale per column ([N] or [N, 1]: W8A8's "
        "per-channel scales) packed once for w8a8_linear (quant_linear takes it too).",
        py::arg("qweight"), py::arg("scales"));
  m.def("w8a8_linear", &carpool_gemm::w8a8_linear,
        "x [M, K] (float32 or bfloat16) rounded per token to int8 (int8_per_token's steps), "
        "times a pack_w8a8_weight weight in int32: (sum q_x q_w) * scale_x * scale_w (+ bias) "
        "in float32, then x's dtype. Exact sums, so each row is the same bits in any batch.",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_linear", &carpool_gemm::quant_linear,
        "x [M, K] (float32 or bfloat16) @ W.T (+ bias) -> [M, N] in x's dtype, W dequantized "
        "in registers from a packed quantized weight; float32 sums, each row independent of "
        "the others. From rounded_from bfloat16 rows on (0: never), the weight rounded to "
        "bfloat16 instead (the small GEMM's arithmetic; rows then depend on the call's size).",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(),
        py::arg("rounded_from") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_rows", &carpool_gemm::dequantize_rows,
        "Rows [n0, n1) of a packed quantized weight as a [n1 - n0, K] float32 or bfloat16 "
        "tensor (dequantize_ref within a rounding: one fused multiply-add each).",
        py::arg("packed"), py::arg("n0"), py::arg("n1"), py::arg("dtype"),
        py::call_guard<py::gil_scoped_release>());
  using carpool_moe::QuantExperts;
  py::class_<QuantExperts, std::shared_ptr<QuantExperts>>(
      m, "QuantExperts", py::module_local(),
      "A mixture of experts' quantized experts for quant_moe_experts: per expert its gate/up "
      "parts (gate's rows then up's) and its down parts, packed by pack_quant_weight; each "
      "part by quant_linear up to its cut (gate_up_rows / down_rows, one a part), above it "
      "dequantized into a linear, as cpu_quant multiplies a part.")
      .def(py::init<QuantExperts::Parts, QuantExperts::Parts, QuantExperts::Cuts,
                    QuantExperts::Cuts, int64_t>(),
           py::arg("gate_up"), py::arg("down"), py::arg("gate_up_rows"), py::arg("down_rows"),
           py::arg("rounded_from") = 0)
      .def_readonly("hidden", &QuantExperts::hidden)
      .def_readonly("inner", &QuantExperts::inner)
      .def_property_readonly("num_experts", &QuantExperts::experts);
  m.def("quant_moe_experts", &carpool_moe::quant_moe_experts,
        "sum over each row's experts (ascending) of weight * down(silu(gate(x)) * up(x)) for "
        "x [T, H] (float32 or bfloat16), QuantExperts, ids [T, k] int64 and weights [T, k]: "
        "the per-expert loop over quantized linears to the bit, in one call.",
        py::arg("x"), py::arg("experts"), py::arg("ids"), py::arg("weights"),
        py::call_guard<py::gil_scoped_release>());
  m.def("prefill_head_dim_ok", &carpool_prefill::prefill_head_dim_ok,
        "Whether prefill_attention_bf16 takes this head_dim (a multiple of 16 up to 256).");
  m.def("prefill_attention_bf16", &carpool_prefill::prefill_attention_bf16,
        "paged_attention for bfloat16 prompt chunks (no sliding window), on AVX512-BF16, "
        "or with amx=True on AMX tiles (head_dim a multiple of 32).",
        py::arg("out"), py::arg("q"), py::arg("kv_cache"), py::arg("block_tables"),
        py::arg("query_starts"), py::arg("query_lens"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("amx") = false, py::call_guard<py::gil_scoped_release>());
  // Module-local: every build loaded in one process (tests load the AVX2 one beside this
  // CPU's) binds the same C++ types.
  using carpool_layers::DecoderWeights, carpool_layers::LayerStack, carpool_layers::MoeStep,
      carpool_layers::StackLinear, carpool_layers::StackShape;
  using LoraTuple = std::tuple<std::vector<int64_t>, std::vector<int64_t>,
                               std::vector<at::Tensor>, std::vector<at::Tensor>,
                               std::vector<int64_t>>;
  py::class_<StackLinear>(m, "StackLinear", py::module_local(),
                          "A linear layer: its small GEMM up to max_rows rows, else forward.")
      .def(py::init([](at::Tensor packed, int64_t out_features, c10::optional<at::Tensor> bias,
                       bool f32, bool amx, int64_t max_rows, py::function forward) {
             // Called with the GIL released (LayerStack.forward); the function object is
             // copied and freed only where the GIL is held (here, and with the stack).
             auto call = [forward = std::move(forward)](const at::Tensor& x) {
               py::gil_scoped_acquire gil;
               return forward(x).cast<at::Tensor>();
             };
             return StackLinear{std::move(packed), out_features, std::move(bias), f32, amx,
                                max_rows, std::move(call)};
           }),
           py::arg("packed"), py::arg("out_features"), py::arg("bias"), py::arg("f32"),
           py::arg("amx"), py::arg("max_rows"), py::arg("forward"))
      .def_static(
          "quantized",
          [](std::vector<carpool_gemm::QuantWeight> parts, int64_t out_features,
             c10::optional<at::Tensor> bias, int64_t max_rows, int64_t rounded_from,
             py::function forward, bool int8_input) {
            TORCH_CHECK(!parts.empty(), "StackLinear.quantized: no parts");
            auto call = [forward = std::move(forward)](const at::Tensor& x) {
              py::gil_scoped_acquire gil;
              return forward(x).cast<at::Tensor>();
            };
            StackLinear linear{at::Tensor(), out_features, std::move(bias), false, false,
                               max_rows, std::move(call)};
            linear.quant = std::move(parts);
            linear.rounded_from = rounded_from;
            linear.int8_input = int8_input;
            return linear;
          },
          "A quantized linear: quant_linear on each packed part up to max_rows rows (their "
          "outputs side by side, then the bias), else forward; with int8_input the rows are "
          "rounded by int8_per_token first (W8A8).",
          py::arg("parts"), py::arg("out_features"), py::arg("bias"), py::arg("max_rows"),
          py::arg("rounded_from"), py::arg("forward"), py::arg("int8_input") = false);
  py::class_<MoeStep>(m, "MoeStep", py::module_local(),
                      "A sparse layer's MLP: the router's linear, moe_route, moe_experts.")
      .def(py::init([](StackLinear router, at::Tensor gate_up, at::Tensor down, int64_t top_k,
                       bool renormalize, bool round_weights) {
             return MoeStep{std::move(router), std::move(gate_up), std::move(down), top_k,
                            renormalize, round_weights};
           }),
           py::arg("router"), py::arg("gate_up"), py::arg("down"), py::arg("top_k"),
           py::arg("renormalize"), py::arg("round_weights"))
      .def_static(
          "quantized",
          [](StackLinear router, std::shared_ptr<QuantExperts> experts, int64_t top_k,
             bool renormalize, bool round_weights) {
            MoeStep step{std::move(router), at::Tensor(), at::Tensor(), top_k, renormalize,
                         round_weights};
            step.quant = std::move(experts);
            return step;
          },
          "A sparse layer of quantized experts: the router's linear, moe_route, "
          "quant_moe_experts.",
          py::arg("router"), py::arg("experts"), py::arg("top_k"), py::arg("renormalize"),
          py::arg("round_weights"))
      .def_static(
          "module",
          [](py::function forward) {
            MoeStep step;  // called as StackLinear's forward is: the GIL taken for the call
            step.forward = [forward = std::move(forward)](const at::Tensor& x) {
              py::gil_scoped_acquire gil;
              return forward(x).cast<at::Tensor>();
            };
            return step;
          },
          "A sparse layer whose experts the kernel does not take: its block's forward runs "
          "the whole MLP.",
          py::arg("forward"));
  py::class_<DecoderWeights>(m, "DecoderWeights", py::module_local(),
                             "One decoder layer's norms and linears.")
      .def(py::init([](at::Tensor input_norm, at::Tensor post_attention_norm,
                       c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
                       StackLinear qkv, StackLinear o, StackLinear gate_up, StackLinear down) {
             return DecoderWeights{std::move(input_norm), std::move(post_attention_norm),
                                   std::move(q_norm), std::move(k_norm), std::move(qkv),
                                   std::move(o), std::move(gate_up), std::move(down)};
           }),
           py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"))
      .def_static(
          "sparse",
          [](at::Tensor input_norm, at::Tensor post_attention_norm,
             c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
             StackLinear qkv, StackLinear o, MoeStep moe) {
            return DecoderWeights{std::move(input_norm), std::move(post_attention_norm),
                                  std::move(q_norm), std::move(k_norm), std::move(qkv),
                                  std::move(o), StackLinear{}, StackLinear{}, std::move(moe)};
          },
          "A sparse layer: its MLP a mixture of experts (MoeStep).",
          py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("q_norm"),
          py::arg("k_norm"), py::arg("qkv"), py::arg("o"), py::arg("moe"));
  py::class_<StackShape>(m, "StackShape", py::module_local(),
                         "The attention shape and the norms' epsilon of every layer.")
      .def(py::init([](int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                       double scale) {
             return StackShape{num_heads, num_kv_heads, head_dim, eps, scale};
           }),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("scale"));
  py::class_<LayerStack>(m, "LayerStack", py::module_local(),
                         "A model's decoder layers in one call (csrc/layer_stack.cpp).")
      .def(py::init<std::vector<DecoderWeights>, StackShape>(), py::arg("layers"),
           py::arg("shape"))
      .def("forward",
           [](const LayerStack& stack, const at::Tensor& x, const at::Tensor& cos,
              const at::Tensor& sin, const std::vector<at::Tensor>& kv_caches,
              const at::Tensor& slot_mapping, const std::vector<at::Tensor>& paged_rows,
              const std::vector<at::Tensor>& prefill_rows, int64_t sliding_window,
              bool prefill_amx, bool batch_invariant, const std::vector<LoraTuple>& lora) {
             std::vector<carpool_layers::LoraTerm> terms;
             terms.reserve(lora.size());
             for (const LoraTuple& t : lora)
               terms.push_back({std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t),
                                std::get<4>(t)});
             return stack.forward(x, cos, sin, kv_caches, slot_mapping, paged_rows,
                                  prefill_rows, {sliding_window, prefill_amx, batch_invariant},
                                  terms);
           },
           "The layers over x [T, hidden]: the last one's output plus its residual stream; "
           "lora: none, or (starts, ends, a, b, parts) as lora_add_ takes them, four a layer.",
           py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("kv_caches"),
           py::arg("slot_mapping"), py::arg("paged_rows"), py::arg("prefill_rows"),
           py::arg("sliding_window"), py::arg("prefill_amx"), py::arg("batch_invariant"),
           py::arg("lora"),
           py::call_guard<py::gil_scoped_release>());
  m.def("attend", &carpool_attention::attend,
        "A step's attention into a new [T, H, D]: prefill_rows by prefill_attention_bf16 "
        "(amx: on AMX tiles), paged_rows by paged_attention; each list empty or "
        "[block_tables, query_starts, query_lens, seq_lens], together every row of q.",
        py::arg("q"), py::arg("kv_cache"), py::arg("paged_rows"), py::arg("prefill_rows"),
        py::arg("scale"), py::arg("sliding_window"), py::arg("prefill_amx"),
        py::arg("batch_invariant"), py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention", &paged_attention,
        "Paged attention over the cache's block tables; writes out [T, H, D] in place.",
        py::arg("out"), py::arg("q"), py::arg("kv_cache"), py::arg("block_tables"),
        py::arg("query_starts"), py::arg("query_lens"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("sliding_window"), py::arg("batch_invariant") = false,
        py::arg("bf16_widen") = -1,  // bfloat16 decodes by FMAs on widened rows: -1 this CPU's way
        py::call_guard<py::gil_scoped_release>());  // like torch's own ops: other threads run
}
