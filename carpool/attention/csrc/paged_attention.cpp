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
// when the max grows. bfloat16/float16 rows are converted to float32 in registers when one
// register pass covers the item's rows, else into a float32 copy of the block; items of 4+
// rows score a transposed copy of the block (AVX512 builds). The inner loops are in
// block_ops.h. Threads take work items dynamically, longest context first.
//
// batch_invariant: every row is scored one key row at a time (block_scores), never from a
// transposed block, whose sums over head_dim run in another order: the transposed path is
// taken by items of 4+ rows, so without this a query's scores would depend on how many
// queries share its tile (its chunk) and on the number of query heads per kv head. Every
// other step is already per row: the block order (by position), the online softmax, the
// value sums (another row's keys outside a row's range get probability 0 and add exactly 0).

// Narrow headers on purpose: <torch/extension.h> takes about 3x longer to compile.
// The Python binding is in bindings.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "block_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace carpool_cpu;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kQueryTile = 16;  // queries of one request attended per pass over its keys
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Fewer rows than this do not repay a block's transpose (decodes of G <= 3 query heads).
constexpr int kMinTransposedRows = 4;

struct Shapes {
  int64_t num_heads, num_kv_heads, group_size, head_dim;
  int64_t num_cache_blocks, block_size, max_blocks;
  int64_t q_token_stride, q_head_stride, out_token_stride, out_head_stride;
  float scale;
  int64_t sliding_window;  // 0 = none
  int64_t num_vecs;        // head_dim in vectors, rounded up
  int64_t padded_dim;      // num_vecs * Vec::size(): row stride of the float buffers
  int64_t score_stride;    // block_size rounded up to whole vectors
  bool transposed_scores;  // scores from transposed key blocks (block_scores_transposed)
};

struct WorkItem {
  int64_t seq;      // request index
  int64_t q_begin;  // first query of the tile, relative to the request
  int64_t q_end;
  int64_t kv_head;
  int64_t cost;     // keys read times rows, to hand out the longest first
};

// Per-thread buffers; padding columns are zeroed once and never written.
struct Scratch {
  std::vector<float> queries, acc, row_max, row_sum, correction, scores, keys, keys_t, values;
  std::vector<int64_t> key_lo, key_hi;
  void reserve(int64_t rows, const Shapes& s) {
    if (static_cast<int64_t>(row_max.size()) < rows) {
      queries.assign(rows * s.padded_dim, 0.f);
      acc.assign(rows * s.padded_dim, 0.f);
      row_max.resize(rows);
      row_sum.resize(rows);
      correction.resize(rows);
      key_lo.resize(rows);
      key_hi.resize(rows);
      scores.assign(rows * s.score_stride, 0.f);
    }
    if (keys.empty()) {
      keys.assign(s.block_size * s.padded_dim, 0.f);
      keys_t.assign(s.head_dim * s.score_stride, 0.f);
      values.assign(s.block_size * s.padded_dim, 0.f);
    }
  }
};

// Rows [0, n) of a cache block as float32 rows of stride `stride` (the block itself when it
// is float32 and needs no padding, else converted into `buffer`).
template <typename scalar_t>
const float* block_as_float(const scalar_t* block, int64_t n, const Shapes& s, float* buffer,
                            int64_t& stride) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (s.padded_dim == s.head_dim) {
      stride = s.head_dim;
      return block;
    }
  }
  stride = s.padded_dim;
  if (s.padded_dim == s.head_dim) {
    to_float(block, buffer, n * s.head_dim);
  } else {
    for (int64_t t = 0; t < n; ++t) to_float(block + t * s.head_dim, buffer + t * stride, s.head_dim);
  }
  return buffer;
}

// Asks for the cache lines of `bytes` bytes at `p` ahead of use (blocks sit anywhere in the
// cache, so the hardware prefetcher cannot guess the next one).
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

// Online softmax over one block's scores of row r, keys [lo, hi) allowed: scores become
// probabilities relative to the new running max (0 outside [lo, hi)), and correction[r]
// the factor that rescales what the row accumulated before.
inline void softmax_step(float* sc, int64_t lo, int64_t hi, int64_t score_stride,
                         float& row_max, float& row_sum, float& correction) {
  for (int64_t t = 0; t < lo; ++t) sc[t] = kNegInf;
  for (int64_t t = hi; t < score_stride; ++t) sc[t] = kNegInf;
  Vec m(kNegInf);
  for (int64_t t = 0; t < score_stride; t += Vec::size()) m = at::vec::maximum(m, Vec::loadu(sc + t));
  const float block_max = at::vec::vec_reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, m);
  const float new_max = std::max(row_max, block_max);
  correction = (row_max == kNegInf || new_max == row_max) ? 1.f : std::exp(row_max - new_max);
  row_max = new_max;
  const Vec shift(new_max);
  Vec sum(0.f);
  for (int64_t t = 0; t < score_stride; t += Vec::size()) {
    Vec p = (Vec::loadu(sc + t) - shift).exp_u20();
    p.store(sc + t);
  }
  for (int64_t t = 0; t < lo; ++t) sc[t] = 0.f;
  for (int64_t t = hi; t < score_stride; ++t) sc[t] = 0.f;
  for (int64_t t = 0; t < score_stride; t += Vec::size()) sum = sum + Vec::loadu(sc + t);
  row_sum = row_sum * correction + at::vec::vec_reduce_all<float>(std::plus<Vec>(), sum);
}

template <typename scalar_t>
void attend_item(const Shapes& s, const WorkItem& item, const scalar_t* q, const scalar_t* cache,
                 scalar_t* out, const int32_t* block_tables, const int32_t* query_starts,
                 const int32_t* query_lens, const int32_t* seq_lens, Scratch& buf) {
  const int64_t D = s.head_dim, Dp = s.padded_dim, G = s.group_size, BS = s.block_size;
  const int64_t num_queries = item.q_end - item.q_begin;
  const int64_t rows = num_queries * G;  // row r = (query r / G, query head kv_head * G + r % G)
  const int64_t seq_len = seq_lens[item.seq];
  const int64_t first_pos = seq_len - query_lens[item.seq] + item.q_begin;
  const int64_t token0 = query_starts[item.seq] + item.q_begin;
  buf.reserve(rows, s);
  const BlockOps<float>& ops = block_ops<float>();
  const BlockOps<scalar_t>& in_place_ops = block_ops<scalar_t>();
  const int64_t pass_rows = rows_per_pass(s.num_vecs);
  const bool transposed = s.transposed_scores && rows >= kMinTransposedRows;
  // bfloat16/float16 rows that fill whole vectors are converted in registers, not copied
  // first, when one register pass covers all rows (else each pass would convert them again).
  const bool in_place = !std::is_same_v<scalar_t, float> && Dp == D && s.num_vecs % 2 == 0 &&
                        rows <= pass_rows && !transposed;

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = first_pos + r / G, head = item.kv_head * G + r % G;
    const scalar_t* q_row = q + (token0 + r / G) * s.q_token_stride + head * s.q_head_stride;
    float* qf = buf.queries.data() + r * Dp;
    to_float(q_row, qf, D);
    for (int64_t d = 0; d < D; ++d) qf[d] *= s.scale;
    buf.key_lo[r] = s.sliding_window > 0 ? std::max<int64_t>(0, pos - s.sliding_window + 1) : 0;
    buf.key_hi[r] = pos + 1;
    buf.row_max[r] = kNegInf;
    buf.row_sum[r] = 0.f;
  }
  std::fill(buf.acc.begin(), buf.acc.begin() + rows * Dp, 0.f);

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
    if ((b + 1) * BS < keys_end) {  // the next block's keys and values, while this one computes
      const int64_t next = table[b + 1];
      if (next >= 0 && next < s.num_cache_blocks) {
        const int64_t next_keys = std::min(BS, keys_end - (b + 1) * BS);
        prefetch(key_head + next * BS * D, next_keys * D * sizeof(scalar_t));
        prefetch(value_head + next * BS * D, next_keys * D * sizeof(scalar_t));
      }
    }
    int64_t key_stride = D, value_stride = D;
    const scalar_t* key_src = key_head + block * BS * D;
    const float* keys = in_place ? nullptr
                            : block_as_float(key_src, num_keys, s, buf.keys.data(), key_stride);
    if (transposed) {
      at::vec::transpose_mxn<float>(keys, key_stride, buf.keys_t.data(), s.score_stride,
                                    static_cast<int>(num_keys), static_cast<int>(D));
    }
    const int64_t step = transposed ? kMaxTransposedRows : pass_rows;
    for (int64_t r0 = 0; r0 < rows; r0 += step) {
      const int64_t n = std::min(step, rows - r0);
      // Keys any of these rows may attend in this block (rows are in position order).
      const int64_t lo = std::max(buf.key_lo[r0], t0) - t0;
      const int64_t hi = std::min(buf.key_hi[r0 + n - 1], t0 + num_keys) - t0;
      if (lo >= hi) continue;
      float* scores = buf.scores.data() + r0 * s.score_stride;
      if (transposed) {
        ops.transposed[s.score_stride / Vec::size() - 1][n - 1](
            buf.queries.data() + r0 * Dp, Dp, buf.keys_t.data(), D, scores, s.score_stride);
      } else if (keys == nullptr) {
        in_place_ops.scores[s.num_vecs - 1][n - 1](buf.queries.data() + r0 * Dp, Dp, key_src, D,
                                                   lo, hi, scores, s.score_stride);
      } else {
        ops.scores[s.num_vecs - 1][n - 1](buf.queries.data() + r0 * Dp, Dp, keys, key_stride, lo,
                                          hi, scores, s.score_stride);
      }
    }
    bool any_row = false;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t lo = std::max(buf.key_lo[r], t0) - t0;
      const int64_t hi = std::min(buf.key_hi[r], t0 + num_keys) - t0;
      float* sc = buf.scores.data() + r * s.score_stride;
      if (lo >= hi) {  // nothing allowed here: no change to the row
        std::fill(sc, sc + s.score_stride, 0.f);
        buf.correction[r] = 1.f;
        continue;
      }
      any_row = true;
      softmax_step(sc, lo, hi, s.score_stride, buf.row_max[r], buf.row_sum[r], buf.correction[r]);
    }
    if (!any_row) continue;
    const scalar_t* value_src = value_head + block * BS * D;
    const float* values =
        in_place ? nullptr
                 : block_as_float(value_src, num_keys, s, buf.values.data(), value_stride);
    for (int64_t r0 = 0; r0 < rows; r0 += pass_rows) {
      const int64_t n = std::min(pass_rows, rows - r0);
      const int64_t lo = std::max(buf.key_lo[r0], t0) - t0;
      const int64_t hi = std::min(buf.key_hi[r0 + n - 1], t0 + num_keys) - t0;
      if (lo >= hi) continue;
      const float* probs = buf.scores.data() + r0 * s.score_stride;
      float* acc = buf.acc.data() + r0 * Dp;
      if (values == nullptr) {
        in_place_ops.values[s.num_vecs - 1][n - 1](probs, s.score_stride, value_src, D, lo, hi,
                                                   buf.correction.data() + r0, acc, Dp);
      } else {
        ops.values[s.num_vecs - 1][n - 1](probs, s.score_stride, values, value_stride, lo, hi,
                                          buf.correction.data() + r0, acc, Dp);
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = item.kv_head * G + r % G;
    scalar_t* out_row = out + (token0 + r / G) * s.out_token_stride + head * s.out_head_stride;
    store_scaled(buf.acc.data() + r * Dp, 1.f / buf.row_sum[r], out_row, D);
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
                     int64_t sliding_window, bool batch_invariant) {
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
  s.num_vecs = round_up(s.head_dim, Vec::size()) / Vec::size();
  TORCH_CHECK(s.num_vecs <= kMaxVecs, "paged_attention: head_dim ", s.head_dim, " above the ",
              kMaxVecs * Vec::size(), " this build supports");
  s.padded_dim = s.num_vecs * Vec::size();
  s.score_stride = round_up(s.block_size, Vec::size());
#if defined(CPU_CAPABILITY_AVX512)
  s.transposed_scores = !batch_invariant && s.score_stride <= kMaxKeyVecs * Vec::size();
#else
  s.transposed_scores = false;  // ATen's run-time-size transpose is scalar below AVX512
#endif

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
