// Paged attention on the CPU, reading keys and values in place through the block table.
//
// Layout: kv_cache [2, Hkv, num_blocks, block_size, D], contiguous (0 = keys, 1 = values);
// request i's token at position p is row p % block_size of block block_tables[i][p / block_size],
// in every kv head. q and out are [T, H, D] (head_dim contiguous; token and head strides free):
// request i's queries are rows query_starts[i] + j, j < query_lens[i], at positions
// seq_lens[i] - query_lens[i] + j, attending keys k <= p (and p - k < sliding_window if set).
//
// Algorithm: a work item is (request, kv head, tile of up to kQueryTile queries). Its rows are
// the tile's queries times the G = H / Hkv query heads sharing that kv head, so every key and
// value row is read from memory once per tile, not once per query head. Keys are visited one
// cache block at a time, only the blocks some row may attend; a row's allowed keys within a
// block are one contiguous range (causal and window bounds), so no mask is built. The softmax
// is online, in float32: per row a running max and sum, the float32 output accumulator rescaled
// when the max grows. bfloat16/float16 blocks are converted to float32 once per block.
// Threads take work items dynamically, longest context first.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kQueryTile = 16;  // queries of one request attended per pass over its keys
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// n values -> float32 (dst), vectorised.
template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    using VecS = at::vec::Vectorized<scalar_t>;
    int64_t i = 0;
    for (; i + VecS::size() <= n; i += VecS::size()) {
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(VecS::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + Vec::size());
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// dst[d] = scalar_t(src[d] * factor) for d < n.
template <typename scalar_t>
inline void store_scaled(const float* src, float factor, scalar_t* dst, int64_t n) {
  const Vec f(factor);
  int64_t i = 0;
  if constexpr (std::is_same_v<scalar_t, float>) {
    for (; i + Vec::size() <= n; i += Vec::size()) (Vec::loadu(src + i) * f).store(dst + i);
  } else {
    using VecS = at::vec::Vectorized<scalar_t>;
    for (; i + VecS::size() <= n; i += VecS::size()) {
      Vec lo = Vec::loadu(src + i) * f;
      Vec hi = Vec::loadu(src + i + Vec::size()) * f;
      at::vec::convert_from_float<scalar_t>(lo, hi).store(dst + i);
    }
  }
  for (; i < n; ++i) dst[i] = static_cast<scalar_t>(src[i] * factor);
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) {
    acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  }
  if (d < n) acc = at::vec::fmadd(Vec::loadu(a + d, n - d), Vec::loadu(b + d, n - d), acc);
  return at::vec::vec_reduce_all<float>(std::plus<Vec>(), acc);
}

// y[d] = y[d] * beta + w * x[d] for d < n.
inline void scale_add(float beta, float w, const float* x, float* y, int64_t n) {
  const Vec b(beta), wv(w);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) {
    at::vec::fmadd(wv, Vec::loadu(x + d), Vec::loadu(y + d) * b).store(y + d);
  }
  for (; d < n; ++d) y[d] = y[d] * beta + w * x[d];
}

// y[d] += w * x[d] for d < n.
inline void axpy(float w, const float* x, float* y, int64_t n) {
  const Vec wv(w);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) {
    at::vec::fmadd(wv, Vec::loadu(x + d), Vec::loadu(y + d)).store(y + d);
  }
  if (d < n) at::vec::fmadd(wv, Vec::loadu(x + d, n - d), Vec::loadu(y + d, n - d)).store(y + d, n - d);
}

struct Shapes {
  int64_t num_heads, num_kv_heads, group_size, head_dim;
  int64_t num_cache_blocks, block_size, max_blocks;
  int64_t q_token_stride, q_head_stride, out_token_stride, out_head_stride;
  float scale;
  int64_t sliding_window;  // 0 = none
};

struct WorkItem {
  int64_t seq;      // request index
  int64_t q_begin;  // first query of the tile, relative to the request
  int64_t q_end;
  int64_t kv_head;
  int64_t cost;     // keys read times rows, to hand out the longest first
};

// Per-thread buffers, grown on demand.
struct Scratch {
  std::vector<float> queries, acc, row_max, row_sum, scores, keys, values;
  std::vector<int64_t> key_lo, key_hi;
  void reserve(int64_t rows, const Shapes& s) {
    queries.resize(rows * s.head_dim);
    acc.resize(rows * s.head_dim);
    row_max.resize(rows);
    row_sum.resize(rows);
    key_lo.resize(rows);
    key_hi.resize(rows);
    scores.resize(rows * s.block_size);
    keys.resize(s.block_size * s.head_dim);
    values.resize(s.block_size * s.head_dim);
  }
};

template <typename scalar_t>
void attend_item(const Shapes& s, const WorkItem& item, const scalar_t* q, const scalar_t* cache,
                 scalar_t* out, const int32_t* block_tables, const int32_t* query_starts,
                 const int32_t* query_lens, const int32_t* seq_lens, Scratch& buf) {
  const int64_t D = s.head_dim, G = s.group_size, BS = s.block_size;
  const int64_t num_queries = item.q_end - item.q_begin;
  const int64_t rows = num_queries * G;  // row r = (query r / G, query head kv_head * G + r % G)
  const int64_t seq_len = seq_lens[item.seq];
  const int64_t first_pos = seq_len - query_lens[item.seq] + item.q_begin;
  const int64_t token0 = query_starts[item.seq] + item.q_begin;
  buf.reserve(rows, s);

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = first_pos + r / G, head = item.kv_head * G + r % G;
    const scalar_t* q_row = q + (token0 + r / G) * s.q_token_stride + head * s.q_head_stride;
    float* qf = buf.queries.data() + r * D;
    to_float(q_row, qf, D);
    for (int64_t d = 0; d < D; ++d) qf[d] *= s.scale;
    buf.key_lo[r] = s.sliding_window > 0 ? std::max<int64_t>(0, pos - s.sliding_window + 1) : 0;
    buf.key_hi[r] = pos + 1;
    buf.row_max[r] = kNegInf;
    buf.row_sum[r] = 0.f;
  }
  std::fill(buf.acc.begin(), buf.acc.begin() + rows * D, 0.f);

  const int64_t keys_begin = buf.key_lo[0], keys_end = buf.key_hi[rows - 1];
  const int32_t* table = block_tables + item.seq * s.max_blocks;
  const int64_t head_stride = s.num_cache_blocks * BS * D;  // one head's blocks in the cache
  const scalar_t* key_head = cache + item.kv_head * head_stride;
  const scalar_t* value_head = cache + (s.num_kv_heads + item.kv_head) * head_stride;

  for (int64_t b = keys_begin / BS; b * BS < keys_end; ++b) {
    const int64_t block = table[b];
    TORCH_CHECK(block >= 0 && block < s.num_cache_blocks, "paged_attention: block id ", block,
                " of request ", item.seq, " is outside the cache (", s.num_cache_blocks, " blocks)");
    const int64_t t0 = b * BS, num_keys = std::min(BS, keys_end - t0);
    const scalar_t* key_src = key_head + block * BS * D;
    const float* keys;
    if constexpr (std::is_same_v<scalar_t, float>) {
      keys = key_src;
    } else {
      to_float(key_src, buf.keys.data(), num_keys * D);
      keys = buf.keys.data();
    }
    // Scores and online softmax: row r attends keys [lo, hi) of this block.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t lo = std::max(buf.key_lo[r], t0) - t0;
      const int64_t hi = std::min(buf.key_hi[r], t0 + num_keys) - t0;
      float* sc = buf.scores.data() + r * BS;
      if (lo >= hi) {
        std::fill(sc, sc + BS, 0.f);
        continue;
      }
      const float* qf = buf.queries.data() + r * D;
      float block_max = kNegInf;
      for (int64_t t = lo; t < hi; ++t) {
        sc[t] = dot(qf, keys + t * D, D);
        block_max = std::max(block_max, sc[t]);
      }
      const float old_max = buf.row_max[r];
      const float new_max = std::max(old_max, block_max);
      if (new_max > old_max && old_max != kNegInf) {
        const float correction = std::exp(old_max - new_max);
        buf.row_sum[r] *= correction;
        float* acc = buf.acc.data() + r * D;
        for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
      }
      buf.row_max[r] = new_max;
      float sum = 0.f;
      for (int64_t t = 0; t < lo; ++t) sc[t] = 0.f;
      for (int64_t t = lo; t < hi; ++t) {
        sc[t] = std::exp(sc[t] - new_max);
        sum += sc[t];
      }
      for (int64_t t = hi; t < BS; ++t) sc[t] = 0.f;
      buf.row_sum[r] += sum;
    }
    // Values: acc[r] += sum_t p[r][t] * v[t].
    const scalar_t* value_src = value_head + block * BS * D;
    const float* values;
    if constexpr (std::is_same_v<scalar_t, float>) {
      values = value_src;
    } else {
      to_float(value_src, buf.values.data(), num_keys * D);
      values = buf.values.data();
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t lo = std::max(buf.key_lo[r], t0) - t0;
      const int64_t hi = std::min(buf.key_hi[r], t0 + num_keys) - t0;
      const float* sc = buf.scores.data() + r * BS;
      float* acc = buf.acc.data() + r * D;
      for (int64_t t = lo; t < hi; ++t) axpy(sc[t], values + t * D, acc, D);
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = item.kv_head * G + r % G;
    scalar_t* out_row = out + (token0 + r / G) * s.out_token_stride + head * s.out_head_stride;
    store_scaled(buf.acc.data() + r * D, 1.f / buf.row_sum[r], out_row, D);
  }
}

std::vector<WorkItem> plan(const Shapes& s, const int32_t* query_lens, const int32_t* seq_lens,
                           int64_t num_seqs) {
  std::vector<WorkItem> items;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_len = query_lens[i], seq_len = seq_lens[i];
    TORCH_CHECK(q_len >= 0 && q_len <= seq_len, "paged_attention: request ", i, " has query_len ",
                q_len, " and seq_len ", seq_len, " (need 0 <= query_len <= seq_len)");
    TORCH_CHECK(seq_len <= s.max_blocks * s.block_size, "paged_attention: request ", i,
                " has seq_len ", seq_len, " beyond its block table (", s.max_blocks, " blocks of ",
                s.block_size, ")");
    for (int64_t begin = 0; begin < q_len; begin += kQueryTile) {
      const int64_t end = std::min(q_len, begin + kQueryTile);
      const int64_t last_pos = seq_len - q_len + end - 1;
      int64_t num_keys = last_pos + 1;
      if (s.sliding_window > 0) num_keys = std::min(num_keys, s.sliding_window + end - begin);
      for (int64_t h = 0; h < s.num_kv_heads; ++h) {
        items.push_back({i, begin, end, h, num_keys * (end - begin)});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

void check_index(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == dim &&
                  t.is_contiguous(),
              "paged_attention: ", name, " must be a contiguous int32 CPU tensor of ", dim, " dims");
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_starts,
                     const at::Tensor& query_lens, const at::Tensor& seq_lens, double scale,
                     int64_t sliding_window) {
  TORCH_CHECK(q.device().is_cpu() && out.device().is_cpu() && kv_cache.device().is_cpu(),
              "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "paged_attention: q and out must be [T, H, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_attention: kv_cache must be a contiguous [2, Hkv, num_blocks, block_size, D]");
  TORCH_CHECK(q.scalar_type() == out.scalar_type() && q.scalar_type() == kv_cache.scalar_type(),
              "paged_attention: q, out and kv_cache must share a dtype");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_attention: head_dim must be contiguous");
  TORCH_CHECK(kv_cache.size(4) == q.size(2), "paged_attention: head_dim differs between q and cache");
  check_index(block_tables, "block_tables", 2);
  check_index(query_starts, "query_starts", 1);
  check_index(query_lens, "query_lens", 1);
  check_index(seq_lens, "seq_lens", 1);
  const int64_t num_seqs = block_tables.size(0);
  TORCH_CHECK(query_starts.size(0) == num_seqs && query_lens.size(0) == num_seqs &&
                  seq_lens.size(0) == num_seqs,
              "paged_attention: one query_start, query_len and seq_len per block table row");
  TORCH_CHECK(sliding_window >= 0, "paged_attention: sliding_window must be >= 0");

  Shapes s;
  s.num_heads = q.size(1);
  s.num_kv_heads = kv_cache.size(1);
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0, "paged_attention: ", s.num_heads,
              " query heads are not a multiple of ", s.num_kv_heads, " kv heads");
  s.group_size = s.num_heads / s.num_kv_heads;
  s.head_dim = q.size(2);
  s.num_cache_blocks = kv_cache.size(2);
  s.block_size = kv_cache.size(3);
  s.max_blocks = block_tables.size(1);
  s.q_token_stride = q.stride(0);
  s.q_head_stride = q.stride(1);
  s.out_token_stride = out.stride(0);
  s.out_head_stride = out.stride(1);
  s.scale = static_cast<float>(scale);
  s.sliding_window = sliding_window;

  const int32_t* starts = query_starts.data_ptr<int32_t>();
  const int32_t* q_lens = query_lens.data_ptr<int32_t>();
  const int32_t* s_lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK(starts[i] >= 0 && starts[i] + q_lens[i] <= q.size(0), "paged_attention: request ",
                i, "'s query rows fall outside q");
  }
  const std::vector<WorkItem> items = plan(s, q_lens, s_lens, num_seqs);
  if (items.empty()) return;

  auto run = [&](auto dtype_tag) {
    using scalar_t = decltype(dtype_tag);
    const scalar_t* q_ptr = q.const_data_ptr<scalar_t>();
    const scalar_t* cache_ptr = kv_cache.const_data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    std::atomic<int64_t> next{0};
    const int64_t num_items = static_cast<int64_t>(items.size());
    const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), num_items);
    at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
      Scratch buf;
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
        attend_item<scalar_t>(s, items[i], q_ptr, cache_ptr, out_ptr, tables, starts, q_lens,
                              s_lens, buf);
      }
    });
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(at::BFloat16{}); break;
    case at::kHalf: run(at::Half{}); break;
    default: TORCH_CHECK(false, "paged_attention: float32, bfloat16 or float16 only, got ",
                         q.scalar_type());
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "Paged attention over the cache's block tables; writes out [T, H, D] in place.",
        py::arg("out"), py::arg("q"), py::arg("kv_cache"), py::arg("block_tables"),
        py::arg("query_starts"), py::arg("query_lens"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("sliding_window"));
}
