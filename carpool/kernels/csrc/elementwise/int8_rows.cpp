// int8_per_token(x) -> x': each row of x [M, K] (float32 or bfloat16) rounded to int8 steps
// and scaled back, as compressed-tensors quantizes a W8A8 layer's input with dynamic
// per-token scales, in the bits of the eager oracle `models.quant.weight.int8_per_token`:
// scale = max|x| / 127.5 stored in x's dtype (0 -> the dtype's eps, NaN in a row -> NaN),
// q = clamp(round_half_even(x / scale), -128, 127), x' = q * scale, each quotient and product
// stored in x's dtype as the eager ops store them. Two passes over a row (its max, then the
// rounded values) instead of six eager passes, each with an [M, K] result; rows in parallel.
// int8_per_token_u8 gives the same q as bytes q + 128 with the scales, for W8A8's int8 x int8
// product (gemm/w8a8_gemm.cpp).

// No fused multiply-add: eager rounds the quotient before the product.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace carpool_fused {

namespace {

using Vec = at::vec::Vectorized<float>;

constexpr float kInt8HalfRange = 127.5f;  // models.quant.weight.INT8_HALF_RANGE

template <typename scalar_t>
inline float stored(float v) {
  return static_cast<float>(static_cast<scalar_t>(v));
}

// torch.finfo(dtype).eps: the scale of a row of zeros.
template <typename scalar_t>
constexpr float dtype_eps() {
  return std::is_same_v<scalar_t, float> ? std::numeric_limits<float>::epsilon() : 0.0078125f;
}

template <typename scalar_t>
inline Vec load_n(const scalar_t* p) {
  // Vec::size() values: a bfloat16 row loads half a Vectorized<bfloat16>
  if constexpr (std::is_same_v<scalar_t, float>) {
    return Vec::loadu(p);
  } else {
    auto half = at::vec::Vectorized<scalar_t>::loadu(p, Vec::size());
    return std::get<0>(at::vec::convert_to_float<scalar_t>(half));
  }
}

template <typename scalar_t>
inline void store_n(scalar_t* p, const Vec& v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    v.store(p);
  } else {
    at::vec::convert_from_float<scalar_t>(v, v).store(p, Vec::size());
  }
}

// float -> scalar_t -> float on a vector (ATen's rounding, the eager ops' stores).
template <typename scalar_t>
inline Vec stored_vec(const Vec& v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return v;
  } else {
    return std::get<0>(at::vec::convert_to_float<scalar_t>(at::vec::convert_from_float<scalar_t>(v, v)));
  }
}

// A row's scale: max |x| / 127.5 stored in x's dtype, NaN if the row holds one (amax
// propagates it, as ATen's maximum does), the dtype's eps for a row of zeros.
template <typename scalar_t>
float row_scale(const scalar_t* row, int64_t k) {
  constexpr int64_t W = Vec::size();
  Vec vmax(0.f);
  bool nan = false;
  int64_t i = 0;
  for (; i + W <= k; i += W) {
    vmax = at::vec::maximum(vmax, load_n<scalar_t>(row + i).abs());
  }
  float amax = at::vec::vec_reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  for (; i < k; ++i) {
    float v = static_cast<float>(row[i]);
    nan |= std::isnan(v);
    amax = std::max(amax, std::abs(v));
  }
  nan |= std::isnan(amax);
  float scale = nan ? std::numeric_limits<float>::quiet_NaN()
                    : stored<scalar_t>(amax / kInt8HalfRange);
  if (scale == 0.f) scale = dtype_eps<scalar_t>();
  return scale;
}

// The row's q = clamp(round_half_even(x / scale), -128, 127) (the quotient stored in x's
// dtype first), each vector of W handed to `put(i, q)` and each tail value to `put1(i, q)`.
template <typename scalar_t, typename Put, typename Put1>
void row_steps(const scalar_t* row, int64_t k, float scale, Put put, Put1 put1) {
  constexpr int64_t W = Vec::size();
  const Vec vscale(scale), lo(-128.f), hi(127.f);
  int64_t i = 0;
  for (; i + W <= k; i += W) {
    Vec q = stored_vec<scalar_t>(load_n<scalar_t>(row + i) / vscale).round();
    put(i, at::vec::clamp(q, lo, hi));
  }
  for (; i < k; ++i) {
    float q = std::nearbyint(stored<scalar_t>(static_cast<float>(row[i]) / scale));
    put1(i, std::min(std::max(q, -128.f), 127.f));
  }
}

template <typename scalar_t>
void int8_rows(const scalar_t* x, int64_t x_stride, scalar_t* out, int64_t rows, int64_t k) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(k, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* row = x + r * x_stride;
      scalar_t* dst = out + r * k;
      const float scale = row_scale(row, k);
      const Vec vscale(scale);
      row_steps(row, k, scale, [&](int64_t i, Vec q) { store_n(dst + i, q * vscale); },
                [&](int64_t i, float q) { dst[i] = static_cast<scalar_t>(q * scale); });
    }
  });
}

// The same q as uint8 q + 128 (zero-point 128: what vpdpbusd takes as its unsigned operand),
// row r at out + r * out_stride, its k..out_stride padded with 128 (q = 0), and the scales
// as float32.
template <typename scalar_t>
void int8_rows_u8(const scalar_t* x, int64_t x_stride, uint8_t* out, int64_t out_stride,
                  float* scales, int64_t rows, int64_t k) {
  constexpr int64_t W = Vec::size();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(k, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float q_buf[W];
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* row = x + r * x_stride;
      uint8_t* dst = out + r * out_stride;
      const float scale = row_scale(row, k);
      scales[r] = scale;
      // q is integral in -128..127 (a NaN row's q is left to the conversion; its scale
      // makes the row's products NaN whatever q is)
      row_steps(row, k, scale,
                [&](int64_t i, Vec q) {
                  q.store(q_buf);
                  for (int64_t j = 0; j < W; ++j)
                    dst[i + j] = static_cast<uint8_t>(static_cast<int32_t>(q_buf[j]) + 128);
                },
                [&](int64_t i, float q) {
                  dst[i] = static_cast<uint8_t>(static_cast<int32_t>(q) + 128);
                });
      for (int64_t i = k; i < out_stride; ++i) dst[i] = 128;
    }
  });
}

}  // namespace

at::Tensor int8_per_token(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              "int8_per_token: x must be a CPU tensor [rows, k] with contiguous rows");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat:
      int8_rows<float>(x.const_data_ptr<float>(), x.stride(0), out.data_ptr<float>(),
                       x.size(0), x.size(1));
      break;
    case at::kBFloat16:
      int8_rows<at::BFloat16>(x.const_data_ptr<at::BFloat16>(), x.stride(0),
                              out.data_ptr<at::BFloat16>(), x.size(0), x.size(1));
      break;
    default:
      TORCH_CHECK(false, "int8_per_token: x must be float32 or bfloat16, not ", x.scalar_type());
  }
  return out;
}

void int8_per_token_u8(const at::Tensor& x, uint8_t* out, int64_t out_stride, float* scales) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  out_stride >= x.size(1),
              "int8_per_token_u8: x must be a CPU tensor [rows, k] with contiguous rows");
  switch (x.scalar_type()) {
    case at::kFloat:
      int8_rows_u8<float>(x.const_data_ptr<float>(), x.stride(0), out, out_stride, scales,
                          x.size(0), x.size(1));
      break;
    case at::kBFloat16:
      int8_rows_u8<at::BFloat16>(x.const_data_ptr<at::BFloat16>(), x.stride(0), out,
                                 out_stride, scales, x.size(0), x.size(1));
      break;
    default:
      TORCH_CHECK(false, "int8_per_token: x must be float32 or bfloat16, not ", x.scalar_type());
  }
}

}  // namespace carpool_fused
