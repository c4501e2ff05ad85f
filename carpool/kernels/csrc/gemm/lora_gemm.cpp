// LoRA adapters' term for one linear of one step: out[rows of g] += (x·A_g)·B_g per adapter
// g, in place (lora/step_lora.py; its reference is lora_add_reference).
//
// Why its own loop: a step mixing N adapters adds two or more small matmuls per adapter to
// each of a layer's four linears, and through torch each is an op call of a few rows;
// here one call does every adapter's rows of one linear. Rows are independent work items:
// a row's x·A (its rank's few floats) is kept in registers-sized scratch, then each part's
// B adds into a float32 row accumulator that is added to out once, so a row's result never
// depends on which rows share its step. A is [in, rank] (the parts of a stacked linear side by
// side), each part's B [its rank, its columns], already scaled.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

namespace carpool_gemm {

namespace {

template <typename scalar_t>
void lora_rows(at::Tensor& out, const at::Tensor& x, const std::vector<int64_t>& starts,
               const std::vector<int64_t>& ends, const std::vector<at::Tensor>& a,
               const std::vector<at::Tensor>& b, const std::vector<int64_t>& parts) {
  const int64_t in_features = x.size(1), out_features = out.size(1);
  const int64_t num_parts = static_cast<int64_t>(b.size());
  std::vector<int64_t> row_group;  // (row, group) pairs, row-major
  for (size_t g = 0; g < starts.size(); ++g)
    for (int64_t r = starts[g]; r < ends[g]; ++r) {
      row_group.push_back(r);
      row_group.push_back(static_cast<int64_t>(g));
    }
  const int64_t num_rows = static_cast<int64_t>(row_group.size()) / 2;
  const scalar_t* xs = x.data_ptr<scalar_t>();
  scalar_t* os = out.data_ptr<scalar_t>();
  at::parallel_for(0, num_rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> shrunk, acc(out_features);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = row_group[2 * item], g = row_group[2 * item + 1];
      const at::Tensor& ag = a[g];
      const int64_t rank = ag.size(1);
      const scalar_t* av = ag.data_ptr<scalar_t>();
      shrunk.assign(rank, 0.0f);
      float* t = shrunk.data();
      const scalar_t* xr = xs + row * in_features;
      for (int64_t k = 0; k < in_features; ++k) {
        const float xk = static_cast<float>(xr[k]);
        const scalar_t* ak = av + k * rank;
        for (int64_t j = 0; j < rank; ++j) t[j] += xk * static_cast<float>(ak[j]);
      }
      for (int64_t p = 0; p < num_parts; ++p) {
        if (parts[4 * p] != g) continue;
        const int64_t col0 = parts[4 * p + 1], r0 = parts[4 * p + 2], r1 = parts[4 * p + 3];
        const at::Tensor& bp = b[p];
        const int64_t cols = bp.size(1);
        const scalar_t* bv = bp.data_ptr<scalar_t>();
        float* accum = acc.data();
        for (int64_t c = 0; c < cols; ++c) accum[c] = 0.0f;
        for (int64_t j = r0; j < r1; ++j) {
          const float tj = t[j];
          const scalar_t* bj = bv + (j - r0) * cols;
          for (int64_t c = 0; c < cols; ++c) accum[c] += tj * static_cast<float>(bj[c]);
        }
        scalar_t* orow = os + row * out_features + col0;
        for (int64_t c = 0; c < cols; ++c)
          orow[c] = static_cast<scalar_t>(static_cast<float>(orow[c]) + accum[c]);
      }
    }
  });
}

}  // namespace

void lora_add_(at::Tensor& out, const at::Tensor& x, const std::vector<int64_t>& starts,
               const std::vector<int64_t>& ends, const std::vector<at::Tensor>& a,
               const std::vector<at::Tensor>& b, const std::vector<int64_t>& parts) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && out.size(0) == x.size(0),
              "lora_add_: out [T, O] and x [T, I] must have the same rows");
  TORCH_CHECK(out.is_contiguous() && x.is_contiguous(), "lora_add_: out and x must be contiguous");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "lora_add_: out and x differ in dtype");
  TORCH_CHECK(starts.size() == ends.size() && starts.size() == a.size(),
              "lora_add_: one start, end and A per adapter");
  TORCH_CHECK(parts.size() == 4 * b.size(), "lora_add_: parts holds (group, col0, r0, r1) per B");
  for (size_t g = 0; g < a.size(); ++g) {
    TORCH_CHECK(0 <= starts[g] && starts[g] <= ends[g] && ends[g] <= out.size(0),
                "lora_add_: rows out of range");
    TORCH_CHECK(a[g].dim() == 2 && a[g].size(0) == x.size(1) && a[g].is_contiguous() &&
                    a[g].scalar_type() == x.scalar_type(),
                "lora_add_: each A must be contiguous [in_features, rank] of x's dtype");
  }
  for (size_t p = 0; p < b.size(); ++p) {
    const int64_t g = parts[4 * p], col0 = parts[4 * p + 1], r0 = parts[4 * p + 2],
                  r1 = parts[4 * p + 3];
    TORCH_CHECK(0 <= g && g < static_cast<int64_t>(a.size()), "lora_add_: no adapter ", g);
    TORCH_CHECK(b[p].dim() == 2 && b[p].is_contiguous() && b[p].scalar_type() == x.scalar_type()
                    && b[p].size(0) == r1 - r0 && 0 <= r0 && r1 <= a[g].size(1) && 0 <= col0 &&
                    col0 + b[p].size(1) <= out.size(1),
                "lora_add_: each B must be contiguous [r1 - r0, columns] within out and A");
  }
  if (x.scalar_type() == at::kFloat) {
    lora_rows<float>(out, x, starts, ends, a, b, parts);
  } else if (x.scalar_type() == at::kBFloat16) {
    lora_rows<c10::BFloat16>(out, x, starts, ends, a, b, parts);
  } else {
    TORCH_CHECK(false, "lora_add_: float32 or bfloat16, got ", x.scalar_type());
  }
}

}  // namespace carpool_gemm
