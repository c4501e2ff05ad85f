// Elementwise passes of a decoder layer fused into one pass each, rounding where PyTorch
// rounds (each eager op's result is stored in the tensor's dtype; no fused multiply-add in
// this file, see the pragma).
//
// rotary_(q, k, cos, sin): q [T, H, D] and k [T, Hkv, D] rotated in place (HF's rotate_half
// form: x * cos + rotate_half(x) * sin), one pass instead of the eager path's slices, cat,
// negation, two products and a sum per tensor; the eager path's bits in every dtype. The
// eager `apply_rope` stays the oracle.
//
// rms_norm(x, residual, weight, eps) -> (out, residual_out): for bfloat16/float16 rows.
// With a residual, s = x + residual rounded to the dtype (the eager add), else s = x; then
// out = s * rsqrt(mean(s^2) + eps) * weight in float32, rounded once, as F.rms_norm does
// (its sum of squares runs in another order, so the last bit may differ). One pass over the
// rows instead of the eager add plus F.rms_norm's upcast, pow, mean, add, rsqrt, two
// products and downcast. float32 keeps Hugging Face's eager ops (bitwise HF).
//
// silu_and_mul(gate_up) -> out: out = silu(gate) * up for gate_up = [gate | up] [T, 2I], for
// bfloat16/float16, rounded after the silu and after the product as eager rounds; silu in
// float32 as x / (1 + exp(-x)) with ATen's vectorised exp.
//
// write_kv_(kv_cache, slot_mapping, k, v): this step's k, v [T, Hkv, D] copied to their
// slots of kv_cache [2, Hkv, num_blocks, block_size, D] in one pass (eager: two index_copy_).

// Per file (the other kernels keep contraction): no fused multiply-add, as in eager.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

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


namespace {

// Sum of squares of n floats of a row (already rounded to the dtype), vectorised.
inline float sum_of_squares(const float* s, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec x = Vec::loadu(s + i);
    acc = acc + x * x;
  }
  float total = at::vec::vec_reduce_all<float>(std::plus<Vec>(), acc);
  for (; i < n; ++i) total += s[i] * s[i];
  return total;
}

template <typename scalar_t>
void rms_norm_rows(const at::Tensor& x, const scalar_t* residual, int64_t residual_stride,
                   scalar_t* residual_out, const scalar_t* weight, scalar_t* out, float eps) {
  const int64_t rows = x.size(0), dim = x.size(1), x_stride = x.stride(0);
  const scalar_t* x_data = x.const_data_ptr<scalar_t>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> s(dim);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x_data + r * x_stride;
      int64_t i = 0;
      if (residual != nullptr) {  // s = round(x + residual), kept as the new residual
        const scalar_t* rr = residual + r * residual_stride;
        scalar_t* ro = residual_out + r * dim;
        for (; i + Vec::size() <= dim; i += Vec::size()) {
          const Vec sum = round_to<scalar_t>(load_float(xr + i) + load_float(rr + i));
          sum.store(s.data() + i);
          store_from_float(sum, ro + i);
        }
        for (; i < dim; ++i) {
          ro[i] = static_cast<scalar_t>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
          s[i] = static_cast<float>(ro[i]);
        }
      } else {
        for (; i + Vec::size() <= dim; i += Vec::size()) load_float(xr + i).store(s.data() + i);
        for (; i < dim; ++i) s[i] = static_cast<float>(xr[i]);
      }
      const float rstd = 1.f / std::sqrt(sum_of_squares(s.data(), dim) / dim + eps);
      const Vec scale(rstd);
      scalar_t* o = out + r * dim;
      i = 0;
      for (; i + Vec::size() <= dim; i += Vec::size()) {
        store_from_float(round_to<scalar_t>(Vec::loadu(s.data() + i) * scale * load_float(weight + i)),
                         o + i);
      }
      for (; i < dim; ++i) o[i] = static_cast<scalar_t>(s[i] * rstd * static_cast<float>(weight[i]));
    }
  });
}

template <typename scalar_t>
void silu_and_mul_rows(const at::Tensor& gate_up, scalar_t* out) {
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2, stride = gate_up.stride(0);
  const scalar_t* data = gate_up.const_data_ptr<scalar_t>();
  const Vec one(1.f);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = data + r * stride;
      const scalar_t* up = gate + inner;
      scalar_t* o = out + r * inner;
      // ATen's loop shape: two vectors at a time, then scalar with libm's exp.
      int64_t i = 0;
      for (; i + 2 * Vec::size() <= inner; i += 2 * Vec::size()) {
        for (int64_t j = i; j < i + 2 * Vec::size(); j += Vec::size()) {
          const Vec g = load_float(gate + j);
          const Vec silu = round_to<scalar_t>(g / (one + g.neg().exp()));
          store_from_float(round_to<scalar_t>(silu * load_float(up + j)), o + j);
        }
      }
      for (; i < inner; ++i) {
        const float g = static_cast<float>(gate[i]);
        const float silu = round_to<scalar_t>(g / (1.f + std::exp(-g)));
        o[i] = static_cast<scalar_t>(silu * static_cast<float>(up[i]));
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* op, const char* name, bool float32_too) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, op, ": ", name,
              " must be a CPU tensor [rows, n] with contiguous rows");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf ||
                  (float32_too && t.scalar_type() == at::kFloat),
              op, ": ", name, float32_too ? " must be float32, bfloat16 or float16"
                                          : " must be bfloat16 or float16 (float32 keeps the eager ops)");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x,
                                            const c10::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm", "x", false);
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a contiguous [dim] tensor of x's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  at::Tensor residual_out;
  if (residual.has_value()) {
    check_rows(*residual, "rms_norm", "residual", false);
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must match x");
    residual_out = at::empty_like(out);
  }
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(
        x, residual.has_value() ? residual->const_data_ptr<scalar_t>() : nullptr,
        residual.has_value() ? residual->stride(0) : 0,
        residual.has_value() ? residual_out.data_ptr<scalar_t>() : nullptr,
        weight.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), static_cast<float>(eps));
  });
  return {out, residual_out};
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul", "gate_up", true);
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up must have an even width");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  switch (gate_up.scalar_type()) {
    case at::kFloat: silu_and_mul_rows<float>(gate_up, out.data_ptr<float>()); break;
    case at::kBFloat16: silu_and_mul_rows<at::BFloat16>(gate_up, out.data_ptr<at::BFloat16>()); break;
    default: silu_and_mul_rows<at::Half>(gate_up, out.data_ptr<at::Half>()); break;
  }
  return out;
}

void write_kv_(at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& k,
               const at::Tensor& v) {
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                  kv_cache.is_contiguous(),
              "write_kv_: kv_cache must be a contiguous CPU [2, Hkv, num_blocks, block_size, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.is_contiguous(),
              "write_kv_: slot_mapping must be a contiguous int64 [T]");
  const int64_t num_tokens = slot_mapping.size(0), num_kv_heads = kv_cache.size(1);
  const int64_t head_dim = kv_cache.size(4);
  const int64_t num_slots = kv_cache.size(2) * kv_cache.size(3);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == num_tokens && t->size(1) == num_kv_heads &&
                    t->size(2) == head_dim && t->stride(2) == 1 &&
                    t->scalar_type() == kv_cache.scalar_type(),
                "write_kv_: k and v must be [T, Hkv, D] of the cache's dtype, head_dim contiguous");
  }
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv_: slot ", slots[t],
                " of token ", t, " is outside the cache (", num_slots, " slots)");
  }
  const int64_t elem = kv_cache.element_size(), row_bytes = head_dim * elem;
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const int64_t head_bytes = num_slots * row_bytes, half_bytes = num_kv_heads * head_bytes;
  const char* k_data = static_cast<const char*>(k.const_data_ptr());
  const char* v_data = static_cast<const char*>(v.const_data_ptr());
  at::parallel_for(0, num_tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        char* dst = cache + h * head_bytes + slots[t] * row_bytes;
        std::memcpy(dst, k_data + (t * k.stride(0) + h * k.stride(1)) * elem, row_bytes);
        std::memcpy(dst + half_bytes, v_data + (t * v.stride(0) + h * v.stride(1)) * elem,
                    row_bytes);
      }
    }
  });
}

}  // namespace carpool_fused
