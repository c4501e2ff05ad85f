// Greedy decoding's argmax: each row's largest logit's index, as `logits.max(-1).indices`
// gives it (the first of equal maxima; a row holding NaN: its first NaN).
//
// Why its own loop: every plain greedy step takes the argmax of [rows, vocab] logits, and
// torch's max over a bfloat16 row widens and compares one element at a time, a visible share
// of a small model's decode step (docs/lab/27-dtype-auto-as-vllm-s-the-servers.md).
// Here each row is read once in whole vectors: a lane keeps the largest value it has seen and
// its index (indices held as floats: exact below 2^24, far above any vocabulary), a strict
// "greater" keeps the first of equals in each lane, and the lanes are merged at the end by
// value, then by the smallest index. NaN compares false, so a row is also checked for NaN as
// it is read, and a row that has one is scanned again for its first NaN.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>

namespace carpool_greedy {

namespace {

using Vec = at::vec::Vectorized<float>;

// The first largest of row[0, n) by a plain scan (NaN: the first NaN).
template <typename scalar_t>
int64_t scan_argmax(const scalar_t* row, int64_t n) {
  int64_t at = 0;
  float top = static_cast<float>(row[0]);
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    if (std::isnan(v)) return i;
    if (v > top) {
      top = v;
      at = i;
    }
  }
  return at;
}

// One row of n >= 1 values.
template <typename scalar_t>
int64_t row_argmax(const scalar_t* row, int64_t n) {
  constexpr int64_t kStep = 2 * Vec::size();  // one vector of scalar_t, widened to two
  if (n < kStep) return scan_argmax(row, n);
  auto load = [&](int64_t i, Vec& lo, Vec& hi) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      lo = Vec::loadu(row + i);
      hi = Vec::loadu(row + i + Vec::size());
    } else {
      std::tie(lo, hi) = at::vec::convert_to_float<scalar_t>(
          at::vec::Vectorized<scalar_t>::loadu(row + i));
    }
  };
  Vec best_lo, best_hi;
  load(0, best_lo, best_hi);
  Vec index_lo = Vec::arange(0.f, 1.f), index_hi = Vec::arange(float(Vec::size()), 1.f);
  Vec at_lo = index_lo, at_hi = index_hi, nan_seen = best_lo.isnan() | best_hi.isnan();
  const Vec step(static_cast<float>(kStep));
  int64_t i = kStep;
  for (; i + kStep <= n; i += kStep) {
    Vec lo, hi;
    load(i, lo, hi);
    at_lo = at_lo + step;
    at_hi = at_hi + step;
    const Vec take_lo = lo > best_lo, take_hi = hi > best_hi;
    best_lo = Vec::blendv(best_lo, lo, take_lo);
    index_lo = Vec::blendv(index_lo, at_lo, take_lo);
    best_hi = Vec::blendv(best_hi, hi, take_hi);
    index_hi = Vec::blendv(index_hi, at_hi, take_hi);
    nan_seen = nan_seen | lo.isnan() | hi.isnan();
  }
  alignas(64) float values[kStep], indices[kStep], nans[Vec::size()];
  best_lo.store(values);
  best_hi.store(values + Vec::size());
  index_lo.store(indices);
  index_hi.store(indices + Vec::size());
  nan_seen.store(nans);  // any lane that saw a NaN sends the row to the scan
  for (int64_t l = 0; l < Vec::size(); ++l) {
    if (nans[l] != 0.f) return scan_argmax(row, n);
  }
  // Every lane's first largest; among equal lanes the smallest index; then the tail, whose
  // indices are all larger, only where strictly larger.
  float top = values[0];
  int64_t at = static_cast<int64_t>(indices[0]);
  for (int64_t l = 1; l < kStep; ++l) {
    const int64_t index = static_cast<int64_t>(indices[l]);
    if (values[l] > top || (values[l] == top && index < at)) {
      top = values[l];
      at = index;
    }
  }
  for (; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    if (std::isnan(v)) return i;  // the vectors held none
    if (v > top) {
      top = v;
      at = i;
    }
  }
  return at;
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1 &&
                  logits.size(1) > 0 &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "argmax_rows: logits must be a float32 or bfloat16 CPU [N, V] tensor with V > 0 "
              "and contiguous rows");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  // A few rows per task: a row of a large vocabulary is tens of microseconds.
  const int64_t grain = std::max<int64_t>(1, 32768 / n);
  auto run = [&](const auto* src) {
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) dst[r] = row_argmax(src + r * stride, n);
    });
  };
  if (logits.scalar_type() == at::kFloat) run(logits.const_data_ptr<float>());
  else run(logits.const_data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace carpool_greedy
