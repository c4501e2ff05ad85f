// A mixture of experts' quantized experts in one call a layer (quant_experts.h).
//
// The per-expert loop over QuantLinear modules (models/quant/experts.py, models/moe.py's
// experts_loop) pays Python's dispatch for each of an expert's calls: its gate/up, the SiLU,
// the product, its down, the weight, the sum, for each expert each row hits in each layer,
// which at decode sizes costs more than the experts' multiplies. Here the same calls run in
// C++ on the same tensors: a step's (row, expert) pairs sorted by expert (moe_routing.h),
// each expert's rows through quant_linear on its packed parts (gate/up, then down, the
// quantized GEMM of gemm/quant_gemm.cpp, unchanged), the SiLU and the product by ATen's own
// kernels, and each row's sum over its experts in ascending order, rounded to x's dtype
// after each term as the loop's tensor ops round it. So a row's result is the loop's to the
// bit, and, as each of those calls computes a row alone, independent of the step's other
// rows (the batch-invariant mode relies on it).
//
// Where each expert's rows are few (a decode step), the experts run side by side, one
// thread an expert, in one parallel region: each expert's calls then run whole on their
// thread, as they would across threads, since quant_linear splits only the columns between
// threads and the elementwise calls take one thread below ATen's grain. Otherwise (prompt
// steps) one expert after another, each call across the threads.

#include "moe/quant_experts.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernel_api.h"
#include "moe/moe_routing.h"

namespace carpool_moe {

using carpool_gemm::QuantWeight;

QuantExperts::QuantExperts(Parts gate_up_parts, Parts down_parts, Cuts gate_up_cuts,
                           Cuts down_cuts, int64_t rounded)
    : gate_up(std::move(gate_up_parts)),
      down(std::move(down_parts)),
      gate_up_rows(std::move(gate_up_cuts)),
      down_rows(std::move(down_cuts)),
      rounded_from(rounded) {
  TORCH_CHECK(!gate_up.empty() && gate_up.size() == down.size(), "QuantExperts: ",
              gate_up.size(), " gate/up experts for ", down.size(), " downs");
  TORCH_CHECK(gate_up_rows.size() == gate_up.size() && down_rows.size() == down.size(),
              "QuantExperts: one list of cuts an expert");
  for (size_t e = 0; e < gate_up.size(); ++e) {
    TORCH_CHECK(gate_up_rows[e].size() == gate_up[e].size() &&
                    down_rows[e].size() == down[e].size(),
                "QuantExperts: expert ", e, " needs one cut a part");
  }
  auto width = [](const std::vector<QuantWeight>& parts, const char* what, int64_t k) {
    TORCH_CHECK(!parts.empty(), "QuantExperts: an expert's ", what, " has no parts");
    int64_t n = 0;
    for (const QuantWeight& w : parts) {
      TORCH_CHECK(!w.w8a8 && w.k == k, "QuantExperts: an expert's ", what, " part is not a "
                  "grouped quantized weight of K = ", k);
      n += w.n;
    }
    return n;
  };
  hidden = gate_up[0][0].k;
  inner = width(gate_up[0], "gate/up", hidden) / 2;
  for (size_t e = 0; e < gate_up.size(); ++e) {
    TORCH_CHECK(width(gate_up[e], "gate/up", hidden) == 2 * inner &&
                    width(down[e], "down", inner) == hidden,
                "QuantExperts: expert ", e, " is not gate/up [2 x ", inner, ", ", hidden,
                "] and down [", hidden, ", ", inner, "]");
  }
}

namespace {

// x @ parts.T, the parts' outputs side by side: QuantLinear.forward with cpu_quant's
// part_matmul (quant_rows.quant_matmul) for each part, up to its cut.
at::Tensor multiply(const QuantExperts& experts, const std::vector<QuantWeight>& parts,
                    const std::vector<int64_t>& cuts, const at::Tensor& x) {
  std::vector<at::Tensor> outs;
  outs.reserve(parts.size());
  for (size_t p = 0; p < parts.size(); ++p) {
    const QuantWeight& w = parts[p];
    outs.push_back(x.size(0) <= cuts[p]
                       ? carpool_gemm::quant_linear(x, w, c10::nullopt, experts.rounded_from)
                       : at::linear(x, carpool_gemm::dequantize_rows(w, 0, w.n,
                                                                      x.scalar_type())));
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs, 1);
}

// down(silu(gate(x)) * up(x)) for one expert's rows (n of them, `rows` ascending) of x.
at::Tensor expert_output(const QuantExperts& experts, int64_t e, const at::Tensor& x,
                         const int64_t* rows, int64_t n) {
  bool all = n == x.size(0);
  for (int64_t i = 0; all && i < n; ++i) all = rows[i] == i;
  at::Tensor xe = x;
  if (!all) {
    at::Tensor index = at::empty({n}, x.options().dtype(at::kLong));
    std::copy(rows, rows + n, index.data_ptr<int64_t>());
    xe = x.index_select(0, index);
  }
  const at::Tensor gate_up = multiply(experts, experts.gate_up[e], experts.gate_up_rows[e], xe);
  const int64_t I = experts.inner;
  const at::Tensor act = at::silu(gate_up.narrow(1, 0, I)).mul_(gate_up.narrow(1, I, I));
  return multiply(experts, experts.down[e], experts.down_rows[e], act);
}

// v rounded to S, as a tensor op's result in S is: float32 results are kept as they are, and
// out of the next sum's reach (each op of the loop rounds its own result, so the compiler's
// contraction of a product and the sum after it into one multiply-add must not happen).
template <typename S>
inline float round_to(float v) {
  if constexpr (std::is_same_v<S, float>) {
#if defined(__x86_64__)
    asm("" : "+x"(v));
#elif defined(__aarch64__)
    asm("" : "+w"(v));
#else
    volatile float kept = v;
    v = kept;
#endif
    return v;
  } else {
    return static_cast<float>(static_cast<S>(v));
  }
}

// out[t] = the sum over row t's experts, ascending, of round(y * weight), each partial sum
// rounded to S: `out + (y * w).to(S)` term by term, as the loop computes it.
template <typename S>
void weighted_sum_rounded(const std::vector<at::Tensor>& outs, const Routing& r,
                          const int64_t* ids, const float* w, int64_t k, at::Tensor& out) {
  const int64_t T = out.size(0), H = out.size(1);
  S* o = out.data_ptr<S>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(H);
    std::vector<int64_t> order(k);
    for (int64_t t = begin; t < end; ++t) {
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(),
                [&](int64_t a, int64_t b) { return ids[t * k + a] < ids[t * k + b]; });
      for (int64_t i = 0; i < k; ++i) {
        const int64_t s = order[i], e = ids[t * k + s];
        const S* y = outs[e].const_data_ptr<S>() + (r.sorted[t * k + s] - r.starts[e]) * H;
        const float scale = w[t * k + s];
        for (int64_t h = 0; h < H; ++h) {
          const float term = round_to<S>(static_cast<float>(y[h]) * scale);
          sum[h] = i == 0 ? term : round_to<S>(sum[h] + term);
        }
      }
      for (int64_t h = 0; h < H; ++h) o[t * H + h] = static_cast<S>(sum[h]);
    }
  });
}

}  // namespace

at::Tensor quant_moe_experts(const at::Tensor& x, const QuantExperts& experts,
                             const at::Tensor& ids, const at::Tensor& weights) {
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && weights.sizes() == ids.sizes() &&
                  ids.size(0) == x.size(0), "quant_moe_experts: x [T, H], ids and weights "
              "[T, k]");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "quant_moe_experts: ids must be int64");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_moe_experts: x must be float32 or bfloat16");
  TORCH_CHECK(x.size(1) == experts.hidden, "quant_moe_experts: x has ", x.size(1),
              " columns, the experts take ", experts.hidden);
  const int64_t T = x.size(0), k = ids.size(1), E = experts.experts();
  at::Tensor out = at::empty({T, experts.hidden}, x.options());
  if (T == 0) return out;
  const at::Tensor xc = x.contiguous(), id = ids.contiguous();
  const at::Tensor wt = weights.to(at::kFloat).contiguous();
  const Routing r = sort_by_expert(id, E);
  const int64_t active = static_cast<int64_t>(r.active.size());
  // One thread an expert where every call of every expert stays below its cut (quant_linear,
  // whose rows never depend on the threads) and below ATen's grain (one-thread elementwise).
  bool side_by_side = active > 1 && at::get_num_threads() > 1 && !at::in_parallel_region();
  for (int64_t e : r.active) {
    const int64_t n = r.starts[e + 1] - r.starts[e];
    side_by_side = side_by_side && n * 2 * experts.inner < at::internal::GRAIN_SIZE;
    for (const auto* cuts : {&experts.gate_up_rows[e], &experts.down_rows[e]})
      for (int64_t cut : *cuts) side_by_side = side_by_side && n <= cut;
  }
  std::vector<at::Tensor> outs(E);
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t a = begin; a < end; ++a) {
      const int64_t e = r.active[a];
      outs[e] = expert_output(experts, e, xc, r.rows.data() + r.starts[e],
                              r.starts[e + 1] - r.starts[e]).contiguous();
    }
  };
  if (side_by_side) {
    at::parallel_for(0, active, 1, run);
  } else {
    run(0, active);
  }
  if (x.scalar_type() == at::kBFloat16) {
    weighted_sum_rounded<at::BFloat16>(outs, r, id.const_data_ptr<int64_t>(),
                                       wt.const_data_ptr<float>(), k, out);
  } else {
    weighted_sum_rounded<float>(outs, r, id.const_data_ptr<int64_t>(),
                                wt.const_data_ptr<float>(), k, out);
  }
  return out;
}

}  // namespace carpool_moe
