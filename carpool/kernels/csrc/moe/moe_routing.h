// A step's (row, expert) pairs sorted by expert, and each row's weighted sum of its experts'
// outputs: the two ends of moe_experts' every path.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace carpool_moe {
namespace {

struct Routing {
  std::vector<int64_t> starts;  // [E + 1]: expert e's pairs are [starts[e], starts[e + 1])
  std::vector<int64_t> rows;  // per sorted pair: its row
  std::vector<int64_t> sorted;  // per pair t * k + s: its place in the sorted order
  std::vector<int64_t> active;  // the experts with pairs, ascending
};

Routing sort_by_expert(const at::Tensor& ids, int64_t num_experts) {
  const int64_t pairs = ids.numel(), k = ids.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  Routing r;
  r.starts.assign(num_experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < num_experts, "moe_experts: expert id ", id[p],
                " out of range for ", num_experts, " experts");
    ++r.starts[id[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    if (r.starts[e + 1]) r.active.push_back(e);
    r.starts[e + 1] += r.starts[e];
  }
  std::vector<int64_t> next(r.starts.begin(), r.starts.end() - 1);
  r.rows.resize(pairs);
  r.sorted.resize(pairs);
  for (int64_t p = 0; p < pairs; ++p) {  // rows ascending within each expert
    const int64_t place = next[id[p]]++;
    r.rows[place] = p / k;
    r.sorted[p] = place;
  }
  return r;
}

// out [T, H] (float32 or bfloat16): each row's experts' outputs (y [pairs, ldy] float32, in
// sorted order) times their weights (w [T, k] float32), summed in ascending expert order and
// rounded once.
void weighted_sum(const float* y, int64_t ldy, const float* w, const int64_t* ids, int64_t k,
                  const Routing& r, at::Tensor& out) {
  const int64_t T = out.size(0), H = out.size(1);
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(H);
    std::vector<int64_t> order(k);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t s = 0; s < k; ++s) order[s] = s;
      std::sort(order.begin(), order.end(),
                [&](int64_t a, int64_t b) { return ids[t * k + a] < ids[t * k + b]; });
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t s : order) {
        const float* row = y + r.sorted[t * k + s] * ldy;
        const float scale = w[t * k + s];
        for (int64_t h = 0; h < H; ++h) sum[h] += row[h] * scale;
      }
      if (bf16) {
        at::BFloat16* o = out.data_ptr<at::BFloat16>() + t * H;
        for (int64_t h = 0; h < H; ++h) o[h] = static_cast<at::BFloat16>(sum[h]);
      } else {
        std::copy(sum.begin(), sum.end(), out.data_ptr<float>() + t * H);
      }
    }
  });
}

}  // namespace
}  // namespace carpool_moe
