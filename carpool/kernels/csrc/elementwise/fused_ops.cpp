// Elementwise passes of a decoder layer fused into one pass each, rounding where PyTorch
// rounds (each eager op's result is stored in the tensor's dtype; no fused multiply-add in
// this file, see the pragma). On AVX-512 and AVX2 the rounding float -> bfloat16/float16 ->
// float is done on one vector (ATen's round-to-nearest-even with NaN -> 0xffff in integer ops for
// bfloat16, one vcvtps2ph/vcvtph2ps round trip for float16), the same bits as ATen's
// conversions (checked over all 2^32 floats), instead of two vectors each way.
//
// rotary_(q, k, cos, sin): q [T, H, D] and k [T, Hkv, D] rotated in place (HF's rotate_half
// form: x * cos + rotate_half(x) * sin), one pass instead of the eager path's slices, cat,
// negation, two products and a sum per tensor; the eager path's bits in every dtype. The
// eager `apply_rope` stays the oracle.
//
// rms_norm(x, residual, weight, eps) -> (out, residual_out): x [rows, dim], or x [T, H, dim]
// (each head a row, no residual: Qwen3's per-head q and k norms on the projection's views).
// With a residual, s = x + residual rounded to the dtype (the eager add), else s = x; then
// out = s * rsqrt(mean(s^2) + eps) * weight in float32, rounded once, as F.rms_norm does
// (its sum of squares runs in another order, so the last bit may differ). Two passes over a
// row (the sum, stored, and its squares; then the scaled output from the stored sum) instead
// of the eager add plus F.rms_norm's upcast, pow, mean, add, rsqrt, two products and
// downcast. For float32, Hugging Face's eager ops to the bit in one call: s = residual + x
// (or x) and s * s in one pass, the row sums by at::sum (what eager's mean runs, so the same
// sums in the same order), then weight * (s * (1 / sqrt(sum / dim + eps))) in a second pass,
// each operation rounded as eager rounds it: two passes and a sum for eager's seven ops.
//
// silu_and_mul(gate_up) -> out: out = silu(gate) * up for gate_up = [gate | up] [T, 2I],
// rounded after the silu and after the product as eager rounds, eager's bits in every dtype
// (NaNs included): silu in float32 as x / (1 + exp(-x)) with ATen's vectorised exp where eager
// vectorises, libm's exp in the row tails where eager runs scalar. For bfloat16 the
// vectorised silu is a lookup in a 65536-entry table built once with that formula.
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
#include <ATen/ops/sum.h>
#include <c10/util/Exception.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <algorithm>
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

// The vector rounding as ATen's conversions do it (two vectors each way): the generic path.
template <typename scalar_t>
inline Vec round_to_aten(const Vec& x) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return x;
  } else {
    auto packed = at::vec::convert_from_float<scalar_t>(x, x);
    return std::get<0>(at::vec::convert_to_float<scalar_t>(packed));
  }
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#define CARPOOL_ONE_VECTOR_ROUNDING
constexpr int kRoundNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // ATen's fp16 mode
#endif

// Per vector width: ATen's cvtfp32_bf16 on one vector (round to nearest even: add 0x7fff + the
// kept lsb; NaN -> 0xffff; the bfloat16 bits in the high half of each lane, the low half
// garbage), that rounding back in float (bf16_rounded) or packed to 16-bit lanes (bf16_packed),
// the float16 counterparts by one vcvtps2ph (/ vcvtph2ps), and the packed lanes' store.
#if defined(CPU_CAPABILITY_AVX512)
using Packed16 = __m256i;
inline __m512i bf16_rounded_bits(const __m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)), bits);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), _mm512_set1_epi32(-1), sum);
}
inline __m512 bf16_rounded(const __m512 x) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(bf16_rounded_bits(x), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline Packed16 bf16_packed(const __m512 x) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(x), 16));
}
inline Packed16 half_packed(const __m512 x) { return _mm512_cvtps_ph(x, kRoundNearest); }
inline __m512 half_rounded(const __m512 x) { return _mm512_cvtph_ps(half_packed(x)); }
inline void store_packed(const Packed16 packed, void* dst) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed);
}
#elif defined(CPU_CAPABILITY_AVX2)
using Packed16 = __m128i;
inline __m256i bf16_rounded_bits(const __m256 x) {  // ATen's AVX2 cvtfp32_bf16 rounds alike
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)), bits);
  return _mm256_blendv_epi8(_mm256_set1_epi32(-1), sum,
                            _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q)));
}
inline __m256 bf16_rounded(const __m256 x) {
  return _mm256_castsi256_ps(
      _mm256_and_si256(bf16_rounded_bits(x), _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline Packed16 bf16_packed(const __m256 x) {
  // packus works per 128 bits, so the halves' low quadwords are joined after it
  const __m256i bits = _mm256_srli_epi32(bf16_rounded_bits(x), 16);
  return _mm256_castsi256_si128(
      _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), _MM_SHUFFLE(3, 1, 2, 0)));
}
inline Packed16 half_packed(const __m256 x) { return _mm256_cvtps_ph(x, kRoundNearest); }
inline __m256 half_rounded(const __m256 x) { return _mm256_cvtph_ps(half_packed(x)); }
inline void store_packed(const Packed16 packed, void* dst) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
}
#endif

// round_to on a vector, the same bits as round_to_aten on one vector instead of two each way.
template <typename scalar_t>
inline Vec round_to(const Vec& x) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return x;
  } else {
#if defined(CARPOOL_ONE_VECTOR_ROUNDING)
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      return bf16_rounded(x);
    } else {
      return half_rounded(x);
    }
#else
    return round_to_aten<scalar_t>(x);
#endif
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

// Vec::size() float values -> dst in scalar_t, rounded as the eager store rounds: the bits of
// round_to(x) (for float32, x itself).
template <typename scalar_t>
inline void store_rounded(const Vec& x, scalar_t* dst) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    x.store(dst);
  } else {
#if defined(CARPOOL_ONE_VECTOR_ROUNDING)
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      store_packed(bf16_packed(x), dst);
    } else {
      store_packed(half_packed(x), dst);
    }
#else
    at::vec::convert_from_float<scalar_t>(x, x).store(dst, Vec::size());
#endif
  }
}

// The first n < Vec::size() values of src -> float (the other lanes 0).
template <typename scalar_t>
inline Vec load_float(const scalar_t* src, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return Vec::loadu(src, n);
  } else {
    return std::get<0>(at::vec::convert_to_float<scalar_t>(at::vec::Vectorized<scalar_t>::loadu(src, n)));
  }
}

// The first n < Vec::size() lanes of x -> dst, rounded as store_rounded rounds.
template <typename scalar_t>
inline void store_rounded(const Vec& x, scalar_t* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    x.store(dst, n);
  } else {
    scalar_t lanes[Vec::size()];
    store_rounded(x, lanes);
    std::memcpy(dst, lanes, n * sizeof(scalar_t));
  }
}

// One row of head_dim values: x[i] = x[i]*cos[i] - x[i+h]*sin[i]; x[i+h] = x[i+h]*cos[i+h] + x[i]*sin[i+h].
// Eager order: x * cos (rounded), rotate_half(x) * sin (rounded), their sum (rounded).
template <typename scalar_t>
inline void rotate_row(scalar_t* x, const scalar_t* cos, const scalar_t* sin, int64_t half) {
  int64_t i = 0;
  for (; i + Vec::size() <= half; i += Vec::size()) {
    const Vec a = load_float(x + i), b = load_float(x + i + half);
    store_rounded(round_to<scalar_t>(a * load_float(cos + i)) +
                      round_to<scalar_t>(b.neg() * load_float(sin + i)),
                  x + i);
    store_rounded(round_to<scalar_t>(b * load_float(cos + i + half)) +
                      round_to<scalar_t>(a * load_float(sin + i + half)),
                  x + i + half);
  }
  if (i < half) {  // the same on a part of a vector (head_dim 16: the whole row)
    const int64_t n = half - i;
    const Vec a = load_float(x + i, n), b = load_float(x + i + half, n);
    store_rounded(round_to<scalar_t>(a * load_float(cos + i, n)) +
                      round_to<scalar_t>(b.neg() * load_float(sin + i, n)),
                  x + i, n);
    store_rounded(round_to<scalar_t>(b * load_float(cos + i + half, n)) +
                      round_to<scalar_t>(a * load_float(sin + i + half, n)),
                  x + i + half, n);
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

// The rows an RMSNorm normalises: those of x [rows, dim], or each head of x [T, H, dim] (q and
// k in a strided projection output, for the per-head norms): row r at
// data + (r / heads) * outer + (r % heads) * inner.
template <typename scalar_t>
struct NormRows {
  const scalar_t* data;
  int64_t count, dim, heads, outer, inner;

  explicit NormRows(const at::Tensor& x)
      : data(x.const_data_ptr<scalar_t>()),
        count(x.dim() == 2 ? x.size(0) : x.size(0) * x.size(1)),
        dim(x.size(-1)),
        heads(x.dim() == 2 ? 1 : x.size(1)),
        outer(x.stride(0)),
        inner(x.dim() == 2 ? 0 : x.stride(1)) {}

  const scalar_t* row(int64_t r) const { return data + (r / heads) * outer + (r % heads) * inner; }
};

// Per row: s = round(x + residual) stored as the new residual (or s = x), its sum of squares
// accumulated in the same pass (16 lanes, then the lanes summed, then the tail in order), then
// out = round(s * rstd * weight) from s re-read in the dtype (exact). Two passes, no buffer.
template <typename scalar_t>
void rms_norm_rows(const NormRows<scalar_t>& x, const scalar_t* residual, int64_t residual_stride,
                   scalar_t* residual_out, const scalar_t* weight, scalar_t* out, float eps) {
  const int64_t rows = x.count, dim = x.dim;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x.row(r);
      const scalar_t* s = xr;
      Vec acc(0.f);
      int64_t i = 0;
      if (residual != nullptr) {  // s = round(x + residual), kept as the new residual
        const scalar_t* rr = residual + r * residual_stride;
        scalar_t* ro = residual_out + r * dim;
        for (; i + Vec::size() <= dim; i += Vec::size()) {
          const Vec sum = round_to<scalar_t>(load_float(xr + i) + load_float(rr + i));
          acc = acc + sum * sum;
          store_rounded(sum, ro + i);
        }
        for (int64_t j = i; j < dim; ++j) {
          ro[j] = static_cast<scalar_t>(static_cast<float>(xr[j]) + static_cast<float>(rr[j]));
        }
        s = ro;
      } else {
        for (; i + Vec::size() <= dim; i += Vec::size()) {
          const Vec v = load_float(xr + i);
          acc = acc + v * v;
        }
      }
      float total = at::vec::vec_reduce_all<float>(std::plus<Vec>(), acc);
      for (int64_t j = i; j < dim; ++j) {
        const float v = static_cast<float>(s[j]);
        total += v * v;
      }
      const float rstd = 1.f / std::sqrt(total / dim + eps);
      const Vec scale(rstd);
      scalar_t* o = out + r * dim;
      i = 0;
      for (; i + Vec::size() <= dim; i += Vec::size()) {
        store_rounded(load_float(s + i) * scale * load_float(weight + i), o + i);
      }
      for (; i < dim; ++i) {
        o[i] = static_cast<scalar_t>(static_cast<float>(s[i]) * rstd *
                                     static_cast<float>(weight[i]));
      }
    }
  });
}

// float32 rows as Hugging Face's eager RMSNorm computes them, every op's rounding and operand
// order kept (x + y and x * y are exact IEEE operations, so vector and scalar lanes agree; only
// which NaN a NaN + NaN carries may differ, as the compiler may swap a scalar add's operands):
// s = residual + x, kept as the new residual (or s = x), squares = s * s (pow(2) is
// base * base); mean = at::sum(squares) over each row / dim (ATen's CPU mean is sum_out, then
// div_ by the count; at::mean itself would cost a second op); out = weight * (s * rstd) with
// rstd = 1 / sqrt(mean + eps) (torch.rsqrt's formula, eps rounded to float as eager's scalar).
void rms_norm_rows_f32(const NormRows<float>& x, const at::Tensor* residual,
                       at::Tensor& summed, const float* weight, float* out, float eps) {
  const int64_t rows = x.count, dim = x.dim;
  at::Tensor squares = at::empty({rows, dim}, at::kFloat);
  float* sq = squares.data_ptr<float>();
  const float* res = residual != nullptr ? residual->const_data_ptr<float>() : nullptr;
  const int64_t res_stride = residual != nullptr ? residual->stride(0) : 0;
  float* s_out = residual != nullptr ? summed.data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x.row(r);
      float* q = sq + r * dim;
      int64_t i = 0;
      if (res != nullptr) {
        const float* rr = res + r * res_stride;
        float* so = s_out + r * dim;
        for (; i + Vec::size() <= dim; i += Vec::size()) {
          const Vec sum = Vec::loadu(rr + i) + Vec::loadu(xr + i);
          sum.store(so + i);
          (sum * sum).store(q + i);
        }
        for (; i < dim; ++i) {
          so[i] = rr[i] + xr[i];
          q[i] = so[i] * so[i];
        }
      } else {
        for (; i + Vec::size() <= dim; i += Vec::size()) {
          const Vec v = Vec::loadu(xr + i);
          (v * v).store(q + i);
        }
        for (; i < dim; ++i) q[i] = xr[i] * xr[i];
      }
    }
  });
  const at::Tensor sums = at::sum(squares, {1}, /*keepdim=*/true);
  const float* sum = sums.const_data_ptr<float>();
  const float count = static_cast<float>(dim);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float rstd = 1.f / std::sqrt(sum[r] / count + eps);
      const float* sr = s_out != nullptr ? s_out + r * dim : x.row(r);
      float* o = out + r * dim;
      const Vec scale(rstd);
      int64_t i = 0;
      for (; i + Vec::size() <= dim; i += Vec::size()) {
        (Vec::loadu(weight + i) * (Vec::loadu(sr + i) * scale)).store(o + i);
      }
      for (; i < dim; ++i) o[i] = weight[i] * (sr[i] * rstd);
    }
  });
}

// silu(g) = g / (1 + exp(-g)) rounded to scalar_t, as ATen's vector loop computes it.
template <typename scalar_t>
inline Vec silu_formula(const Vec& g) {
  return round_to<scalar_t>(g / (Vec(1.f) + g.neg().exp()));
}

// silu_formula for each of the 65536 bit patterns of a bfloat16 g, as floats: built once (a
// thread-safe static) by the formula itself, so a lookup gives the formula's bits.
template <typename scalar_t>
const float* silu_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(1 << 16);
    uint16_t bits[Vec::size()];
    for (int32_t base = 0; base < (1 << 16); base += Vec::size()) {
      for (int j = 0; j < Vec::size(); ++j) bits[j] = static_cast<uint16_t>(base + j);
      const Vec g = load_float(reinterpret_cast<const scalar_t*>(bits));
      silu_formula<scalar_t>(g).store(t.data() + base);
    }
    return t;
  }();
  return table.data();
}

// silu * up with the NaN eager's product gives when both are NaN: x86 returns the first
// operand's NaN, but compilers swap a product's operands at will, so it is picked here (torch's
// float16 mul keeps silu's NaN, its float32 mul up's; bfloat16 rounds every NaN to one pattern).
template <typename scalar_t>
inline Vec silu_times(const Vec& silu, const Vec& up) {
  if constexpr (std::is_same_v<scalar_t, at::Half>) {
    return Vec::blendv(silu * up, silu, silu.isnan());
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    return Vec::blendv(silu * up, up, up.isnan());
  } else {
    return silu * up;
  }
}

template <typename scalar_t>
inline float silu_times(float silu, float up) {
  if constexpr (std::is_same_v<scalar_t, at::Half>) {
    return std::isnan(silu) ? silu : silu * up;
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    return std::isnan(up) ? up : silu * up;
  } else {
    return silu * up;
  }
}

// silu(g) rounded to scalar_t as ATen's scalar loop computes it (libm's exp, scalar rounding).
template <typename scalar_t>
inline float silu_scalar(float g) {
  return round_to<scalar_t>(g / (1.f + std::exp(-g)));
}

// Whether the table lookups run as AVX-512 gathers (16 a vpgatherdd) or one by one: gathers
// win on Intel (Emerald Rapids) and lose on the AMD EPYC measured first (docs/lab/42-an-emerald-rapids-vm-with-vllm-cpu.md).
inline bool lookups_by_gather() {
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
}

// Eager's loop shapes: F.silu steps two Vectorized<scalar_t> (64 bfloat16 on AVX-512), the
// product 32 elements, each finishing its row scalar; the scalar silu differs
// from the vector one (libm's exp) and scalar rounding keeps NaN as 0x7fc0, not 0xffff, so
// each part of a row is computed the way eager computes it there. For bfloat16 the vector
// silu is a lookup (the gate has 65536 values), done in a pass of gathers or scalar loads
// into a float buffer (lookups_by_gather), then the product vectorised. float16 keeps the formula:
// its gates spread over ~8x more table entries than bfloat16's and the lookup measured slower.
template <typename scalar_t>
void silu_and_mul_rows(const at::Tensor& gate_up, scalar_t* out) {
  constexpr bool kTable = std::is_same_v<scalar_t, at::BFloat16>;
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2, stride = gate_up.stride(0);
  const int64_t silu_step = 2 * at::vec::Vectorized<scalar_t>::size();
  // The product's step, found against eager (NaN gates at every position, all 65536 gates):
  // 32 on AVX-512 and AVX2 builds for 16-bit dtypes; float32's is silu's (32 or 16).
  const int64_t mul_step = std::min<int64_t>(silu_step, 32);
  const int64_t silu_vectorised = inner / silu_step * silu_step;
  const int64_t mul_vectorised = inner / mul_step * mul_step;  // >= silu_vectorised
  const scalar_t* data = gate_up.const_data_ptr<scalar_t>();
  const float* table = nullptr;
  if constexpr (kTable) table = silu_table<scalar_t>();  // built here, on the calling thread
  const bool gather = lookups_by_gather();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> silu_row(mul_vectorised);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = data + r * stride;
      const scalar_t* up = gate + inner;
      scalar_t* o = out + r * inner;
      int64_t i = 0;
      if constexpr (kTable) {
        const uint16_t* gate_bits = reinterpret_cast<const uint16_t*>(gate);
#if defined(CPU_CAPABILITY_AVX512)
        for (; gather && i < silu_vectorised; i += 16) {  // silu_step: a multiple of 16
          const __m512i index = _mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gate_bits + i)));
          _mm512_storeu_ps(silu_row.data() + i, _mm512_i32gather_ps(index, table, 4));
        }
#endif
        for (; i < silu_vectorised; ++i) silu_row[i] = table[gate_bits[i]];
      } else {
        for (; i < silu_vectorised; i += Vec::size()) {
          silu_formula<scalar_t>(load_float(gate + i)).store(silu_row.data() + i);
        }
      }
      for (; i < mul_vectorised; ++i) {
        silu_row[i] = silu_scalar<scalar_t>(static_cast<float>(gate[i]));
      }
      for (i = 0; i < mul_vectorised; i += Vec::size()) {
        store_rounded(silu_times<scalar_t>(Vec::loadu(silu_row.data() + i), load_float(up + i)),
                      o + i);
      }
      for (; i < inner; ++i) {
        const float silu = silu_scalar<scalar_t>(static_cast<float>(gate[i]));
        o[i] = static_cast<scalar_t>(silu_times<scalar_t>(silu, static_cast<float>(up[i])));
      }
    }
  });
}

void check_dtype(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
                  t.scalar_type() == at::kHalf,
              op, ": ", name, " must be float32, bfloat16 or float16");
}

void check_rows(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, op, ": ", name,
              " must be a CPU tensor [rows, n] with contiguous rows");
  check_dtype(t, op, name);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x,
                                            const c10::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps) {
  if (x.dim() == 3) {  // each head a row: no residual
    TORCH_CHECK(x.device().is_cpu() && x.stride(2) == 1, "rms_norm: x [T, H, D] must be a CPU "
                "tensor with contiguous heads");
    check_dtype(x, "rms_norm", "x");
    TORCH_CHECK(!residual.has_value(), "rms_norm: a residual needs x [rows, dim]");
  } else {
    check_rows(x, "rms_norm", "x");
  }
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a contiguous [dim] tensor of x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor residual_out;
  if (residual.has_value()) {
    check_rows(*residual, "rms_norm", "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must match x");
    residual_out = at::empty_like(out);
  }
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows_f32(NormRows<float>(x), residual.has_value() ? &*residual : nullptr,
                      residual_out, weight.const_data_ptr<float>(), out.data_ptr<float>(),
                      static_cast<float>(eps));
    return {out, residual_out};
  }
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(
        NormRows<scalar_t>(x),
        residual.has_value() ? residual->const_data_ptr<scalar_t>() : nullptr,
        residual.has_value() ? residual->stride(0) : 0,
        residual.has_value() ? residual_out.data_ptr<scalar_t>() : nullptr,
        weight.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), static_cast<float>(eps));
  });
  return {out, residual_out};
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul", "gate_up");
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
