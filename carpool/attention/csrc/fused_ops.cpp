// Rotary embeddings in one pass, bitwise equal to the PyTorch ops they replace.
//
// rotary_(q, k, cos, sin): q [T, H, D] and k [T, Hkv, D] rotated in place (HF's rotate_half
// form: x * cos + rotate_half(x) * sin), one pass instead of the eager path's slices, cat,
// negation, two products and a sum per tensor. It rounds where PyTorch rounds (each eager
// op's result is stored in the tensor's dtype), so results are the eager path's to the bit
// in float32 and in bfloat16/float16 (no fused multiply-add in this file, see the pragma).
// The eager `apply_rope` stays the oracle. (A fused silu(gate) * up was tried and dropped:
// no faster than eager here, and aten's float32 silu is not reproduced to the bit.)

// Per file (the other kernels keep contraction): no fused multiply-add, as in eager.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Exception.h>

#include <type_traits>

namespace carpool_fused {

using Vec = at::vec::Vectorized<float>;

// float -> scalar_t -> float: the rounding an eager op applies when it stores its result.
template <typename scalar_t>
inline float round_to(float x) {
  return static_cast<float>(static_cast<scalar_t>(x));
}

template <typename scalar_t>
inline Vec round_to(const Vec& x) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return x;
  } else {
    auto packed = at::vec::convert_from_float<scalar_t>(x, x);
    return std::get<0>(at::vec::convert_to_float<scalar_t>(packed));
  }
}

// Vec::size() values of src -> float.
template <typename scalar_t>
inline Vec load_float(const scalar_t* src) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return Vec::loadu(src);
  } else {
    Vec out;
    at::vec::load_to_float<scalar_t>(src, out);
    return out;
  }
}

// Vec::size() float values -> dst in scalar_t (already rounded, so the cast is exact).
template <typename scalar_t>
inline void store_from_float(const Vec& x, scalar_t* dst) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    x.store(dst);
  } else {
    at::vec::convert_from_float<scalar_t>(x, x).store(dst, Vec::size());
  }
}

// One row of head_dim values: x[i] = x[i]*cos[i] - x[i+h]*sin[i]; x[i+h] = x[i+h]*cos[i+h] + x[i]*sin[i+h].
// Eager order: x * cos (rounded), rotate_half(x) * sin (rounded), their sum (rounded).
template <typename scalar_t>
inline void rotate_row(scalar_t* x, const scalar_t* cos, const scalar_t* sin, int64_t half) {
  int64_t i = 0;
  for (; i + Vec::size() <= half; i += Vec::size()) {
    const Vec a = load_float(x + i), b = load_float(x + i + half);
    const Vec first = round_to<scalar_t>(round_to<scalar_t>(a * load_float(cos + i)) +
                                         round_to<scalar_t>(b.neg() * load_float(sin + i)));
    const Vec second =
        round_to<scalar_t>(round_to<scalar_t>(b * load_float(cos + i + half)) +
                           round_to<scalar_t>(a * load_float(sin + i + half)));
    store_from_float(first, x + i);
    store_from_float(second, x + i + half);
  }
  for (; i < half; ++i) {
    const float a = static_cast<float>(x[i]);
    const float b = static_cast<float>(x[i + half]);
    const float first = round_to<scalar_t>(round_to<scalar_t>(a * static_cast<float>(cos[i])) +
                                           round_to<scalar_t>(-b * static_cast<float>(sin[i])));
    const float second =
        round_to<scalar_t>(round_to<scalar_t>(b * static_cast<float>(cos[i + half])) +
                           round_to<scalar_t>(a * static_cast<float>(sin[i + half])));
    x[i] = static_cast<scalar_t>(first);
    x[i + half] = static_cast<scalar_t>(second);
  }
}

template <typename scalar_t>
void rotate(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t num_tokens = x.size(0), num_heads = x.size(1), head_dim = x.size(2);
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  scalar_t* data = x.data_ptr<scalar_t>();
  const scalar_t* cos_data = cos.data_ptr<scalar_t>();
  const scalar_t* sin_data = sin.data_ptr<scalar_t>();
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < num_heads; ++h) {
        rotate_row(data + t * token_stride + h * head_stride, cos_data + t * head_dim,
                   sin_data + t * head_dim, head_dim / 2);
      }
    }
  });
}

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "rotary_: q and k must be [T, heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "rotary_: head_dim must be contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2,
              "rotary_: cos and sin must be contiguous [T, head_dim]");
  TORCH_CHECK(cos.size(0) == q.size(0) && cos.size(1) == q.size(2) && k.size(2) == q.size(2),
              "rotary_: shapes disagree");
  TORCH_CHECK(q.scalar_type() == cos.scalar_type() && k.scalar_type() == q.scalar_type(),
              "rotary_: q, k, cos, sin must share one dtype");
  switch (q.scalar_type()) {
    case at::kFloat: rotate<float>(q, cos, sin); rotate<float>(k, cos, sin); break;
    case at::kBFloat16:
      rotate<at::BFloat16>(q, cos, sin); rotate<at::BFloat16>(k, cos, sin); break;
    case at::kHalf: rotate<at::Half>(q, cos, sin); rotate<at::Half>(k, cos, sin); break;
    default: TORCH_CHECK(false, "rotary_: float32, bfloat16 or float16 only");
  }
}

}  // namespace carpool_fused
