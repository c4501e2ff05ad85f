// A mixture of experts' router after its linear, in one call: per row a float32 softmax over
// the experts' logits, the top k (descending, the lower expert first on ties), renormalised
// to sum to 1 where the model says so. In PyTorch that is five ATen calls a sparse layer
// (softmax, topk, sum, divide, a cast), each paying its dispatch at decode sizes; here one
// pass per row. Rows are independent of each other (the batch-invariant mode needs it).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace carpool_moe {

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k,
                                             bool renormalize) {
  TORCH_CHECK(logits.dim() == 2, "moe_route: logits must be [T, num_experts]");
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= E, "moe_route: top_k ", top_k, " must be in [1, ", E,
              "]");
  const at::Tensor l = logits.to(at::kFloat).contiguous();
  at::Tensor weights = at::empty({T, top_k}, l.options());
  at::Tensor ids = at::empty({T, top_k}, l.options().dtype(at::kLong));
  const float* in = l.data_ptr<float>();
  float* w = weights.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> p(E);
    std::vector<bool> taken(E);
    for (int64_t t = begin; t < end; ++t) {
      const float* row = in + t * E;
      const float top = *std::max_element(row, row + E);
      float sum = 0.f;
      for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(row[e] - top);
      for (int64_t e = 0; e < E; ++e) p[e] /= sum;
      std::fill(taken.begin(), taken.end(), false);
      float picked = 0.f;
      for (int64_t s = 0; s < top_k; ++s) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e)
          if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        taken[best] = true;
        id[t * top_k + s] = best;
        picked += w[t * top_k + s] = p[best];
      }
      if (renormalize)
        for (int64_t s = 0; s < top_k; ++s) w[t * top_k + s] /= picked;
    }
  });
  return {weights, ids};
}

}  // namespace carpool_moe
