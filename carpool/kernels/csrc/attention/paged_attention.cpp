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
// value row is read from memory once per tile, not once per query head. Keys are visited in
// chunks of whole cache blocks (about kChunkKeys keys, at fixed positions: chunk c holds
// positions [c * chunk_keys, (c + 1) * chunk_keys)), only the chunks some row may attend; a
// row's allowed keys within a chunk are one contiguous range (causal and window bounds),
// masked by lane index, so no mask is built. The softmax is online, in float32, one step per
// chunk (not per block: its two horizontal reductions and exp pass then cost little beside
// the FMAs): per row a running max and sum, the float32 output accumulator rescaled when the
// max grows. Scores are taken by row (up to 3 rows share each key row's load; a transpose-add
// tree folds 16 keys' partial sums into one vector), or, for items of kMinTransposedRows+
// rows (prompt tiles) in AVX512 and AVX2 builds, from a transposed float32 copy of the chunk's keys.
// bfloat16/float16 keys and values are converted in registers when one register pass covers
// the item's rows (decodes), else into float32 copies once per chunk. The blocks two chunks
// ahead are prefetched into L2 while one computes, and a thread claims its next item before
// attending the current one, to prefetch that item's first chunks. The inner loops are in
// block_ops.h and bf16_pair_ops.h. Threads take work items
// dynamically, longest context first.
//
// Decodes (single-query items) take their own loops instead, outside batch_invariant:
// decode_one_pass.h's of float32 caches on AVX512 builds (head_dim a multiple of 16) and of
// bfloat16 caches on AVX512-BF16 builds (a multiple of 32); decode_pairs.h's of bfloat16
// caches of head_dim 16 on AVX512-BF16 builds; decode_one_pass_avx2.h's of float32 and
// bfloat16 caches on AVX2 builds (a multiple of 16).
//
// batch_invariant: where the decode loops take the dtype and head_dim, every query row is its
// own single-query item on them, so a prompt or verify row is attended exactly as the same
// position decoded alone (and a row's keys are read once per row, not once per tile: the
// loops' rate per key is what pays for it). Elsewhere every row is scored by row
// (chunk_scores_by_row), never from transposed keys, whose sums over head_dim run in another
// order: the transposed path is taken by items of 4+ rows, so without this a query's scores
// would depend on how many queries share its tile (its chunk) and on the number of query
// heads per kv head. Every other step is already per row: the chunks (fixed positions) and
// their order, the lanes a row masks, the online softmax, the value sums (another row's keys
// outside a row's range get probability 0 and add exactly 0).

// Narrow headers on purpose: <torch/extension.h> takes about 3x longer to compile.
// The Python binding is in bindings.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "attention/bf16_pair_ops.h"
#include "attention/block_ops.h"
#include "attention/decode_one_pass_avx2.h"
#include "attention/decode_pairs.h"
#include "runtime/line_aligned.h"

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
constexpr int64_t kQueryTile = 32;  // queries of one request attended per pass over its keys
constexpr int64_t kChunkKeys = 64;  // keys per online-softmax step (whole blocks, at least one)
constexpr int64_t kPrefetchChunks = 2;  // chunks of keys and values asked for ahead of use
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Fewer rows than this do not repay a chunk's transpose (decodes of G <= 3 query heads).
constexpr int kMinTransposedRows = 4;

struct Shapes {
  int64_t num_heads, num_kv_heads, group_size, head_dim;
  int64_t num_cache_blocks, block_size, max_blocks;
  int64_t q_token_stride, q_head_stride, out_token_stride, out_head_stride;
  float scale;
  int64_t sliding_window;  // 0 = none
  int64_t num_vecs;        // head_dim in vectors, rounded up
  int64_t padded_dim;      // num_vecs * Vec::size(): row stride of the float buffers
  int64_t chunk_keys;      // keys per chunk: whole blocks, about kChunkKeys
  int64_t chunk_stride;    // chunk_keys rounded up to whole vectors: row stride of scores
  bool transposed_scores;  // scores from transposed keys (block_scores_transposed)
};

struct WorkItem {
  int64_t seq;      // request index
  int64_t q_begin;  // first query of the tile, relative to the request
  int64_t q_end;
  int64_t kv_head;
  int64_t cost;     // keys read times rows, to hand out the longest first
};

// Per-thread buffers; padding columns are zeroed once and never written.
template <typename scalar_t>
struct Scratch {
  LineVector<float> queries, acc, row_max, row_sum, correction, scores, keys, keys_t, values;
  LineVector<float> zeros;  // one padded row of zeros: keys outside a chunk's loaded range
  std::vector<scalar_t> zeros_in_place;  // the same in the cache's dtype
  std::vector<int64_t> key_lo, key_hi;
  std::vector<const scalar_t*> key_src, value_src;  // the chunk's rows in the cache
  std::vector<const float*> key_rows, value_rows;   // the same as float32 rows
  LineVector<uint32_t> query_pairs;  // bfloat16 queries as pairs of d (paired items)
  LineVector<uint16_t> value_pairs;  // the chunk's value rows interleaved in pairs of keys
  void reserve(int64_t rows, const Shapes& s) {
    if (static_cast<int64_t>(row_max.size()) < rows) {
      queries.assign(rows * s.padded_dim, 0.f);
      acc.assign(rows * s.padded_dim, 0.f);
      row_max.resize(rows);
      row_sum.resize(rows);
      correction.resize(rows);
      key_lo.resize(rows);
      key_hi.resize(rows);
      scores.assign(rows * s.chunk_stride, 0.f);
      query_pairs.assign(rows * s.padded_dim / 2, 0);
    }
    if (keys.empty()) {
      keys.assign(s.chunk_keys * s.padded_dim, 0.f);
      keys_t.assign(s.head_dim * s.chunk_stride, 0.f);
      values.assign(s.chunk_keys * s.padded_dim, 0.f);
      zeros.assign(s.padded_dim, 0.f);
      zeros_in_place.assign(s.padded_dim, static_cast<scalar_t>(0.f));
      key_src.assign(s.chunk_stride, nullptr);
      value_src.assign(s.chunk_stride, nullptr);
      key_rows.assign(s.chunk_stride, zeros.data());
      value_rows.assign(s.chunk_stride, nullptr);
      value_pairs.assign((s.chunk_stride / 2 + 1) * s.padded_dim * 2, 0);
    }
  }
};

// Asks for the cache lines of `bytes` bytes at `p` ahead of use, into L2 (a chunk of float32
// keys and values fills L1 alone): blocks sit anywhere in the cache, so the hardware
// prefetcher cannot guess the next one. Forced inline, as prefetch_keys: GCC drops the calls
// to a function that only prefetches when it does not inline them (see decode_common.h).
__attribute__((always_inline)) inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}

// The keys [begin, end) of one request and kv head, from the cache into L2.
template <typename scalar_t>
__attribute__((always_inline)) inline void prefetch_keys(const Shapes& s, const int32_t* table,
                                                        const scalar_t* key_head,
                                                        const scalar_t* value_head,
                                                        int64_t begin, int64_t end) {
  const int64_t BS = s.block_size, D = s.head_dim;
  for (int64_t b = begin / BS; b * BS < end; ++b) {
    const int64_t block = table[b];
    if (block < 0 || block >= s.num_cache_blocks) continue;  // attend_item raises on it
    const int64_t first = std::max(begin, b * BS), n = std::min(end, (b + 1) * BS) - first;
    const int64_t offset = (block * BS + first % BS) * D;
    prefetch(key_head + offset, n * D * sizeof(scalar_t));
    prefetch(value_head + offset, n * D * sizeof(scalar_t));
  }
}

// Online softmax over one chunk's scores of a row whose allowed keys are [lo, hi), within
// the chunk's loaded vectors [v_begin, v_end) (those the value sums may read): scores become
// probabilities relative to the new running max (0 outside [lo, hi)), and correction the
// factor that rescales what the row accumulated before.
inline void softmax_step(float* sc, int64_t lo, int64_t hi, int64_t v_begin, int64_t v_end,
                         float& row_max, float& row_sum, float& correction) {
  constexpr int64_t W = Vec::size();
  const int64_t j0 = lo / W, j1 = (hi + W - 1) / W;
  const Vec lo_v(static_cast<float>(lo)), hi_v(static_cast<float>(hi)), neg_inf(kNegInf);
  Vec lane;
  {
    alignas(64) float iota[W];
    for (int64_t i = 0; i < W; ++i) iota[i] = static_cast<float>(i);
    lane = Vec::loadu(iota);
  }
  Vec m(kNegInf);
  for (int64_t j = j0; j < j1; ++j) {
    const Vec idx = lane + Vec(static_cast<float>(j * W));
    const Vec in = (idx >= lo_v) & (idx < hi_v);
    const Vec x = Vec::blendv(neg_inf, Vec::loadu(sc + j * W), in);
    x.store(sc + j * W);
    m = at::vec::maximum(m, x);
  }
  const float chunk_max = at::vec::vec_reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, m);
  const float new_max = std::max(row_max, chunk_max);
  correction = (row_max == kNegInf || new_max == row_max) ? 1.f : std::exp(row_max - new_max);
  row_max = new_max;
  const Vec shift(new_max), zero(0.f);
  Vec sum(0.f);
  for (int64_t j = j0; j < j1; ++j) {
    const Vec x = Vec::loadu(sc + j * W);
    const Vec p = Vec::blendv(zero, (x - shift).exp_u20(), x != neg_inf);
    p.store(sc + j * W);
    sum = sum + p;
  }
  for (int64_t j = v_begin; j < j0; ++j) zero.store(sc + j * W);
  for (int64_t j = std::max(j1, v_begin); j < v_end; ++j) zero.store(sc + j * W);
  row_sum = row_sum * correction + at::vec::vec_reduce_all<float>(std::plus<Vec>(), sum);
}

// Keys [begin, end) some row of the item may attend (its first and last rows' bounds).
std::pair<int64_t, int64_t> item_keys(const Shapes& s, const WorkItem& item,
                                      const int32_t* query_lens, const int32_t* seq_lens) {
  const int64_t first_pos = seq_lens[item.seq] - query_lens[item.seq] + item.q_begin;
  const int64_t last_pos = first_pos + item.q_end - item.q_begin - 1;
  const int64_t begin =
      s.sliding_window > 0 ? std::max<int64_t>(0, first_pos - s.sliding_window + 1) : 0;
  return {begin, last_pos + 1};
}

template <typename scalar_t>
void attend_item(const Shapes& s, const WorkItem& item, const scalar_t* q, const scalar_t* cache,
                 scalar_t* out, const int32_t* block_tables, const int32_t* query_starts,
                 const int32_t* query_lens, const int32_t* seq_lens, const WorkItem* next,
                 Scratch<scalar_t>& buf) {
  constexpr int64_t W = Vec::size();
  constexpr bool is_float = std::is_same_v<scalar_t, float>;
  const int64_t D = s.head_dim, Dp = s.padded_dim, G = s.group_size, BS = s.block_size;
  const int64_t CK = s.chunk_keys, CS = s.chunk_stride;
  const int64_t num_queries = item.q_end - item.q_begin;
  const int64_t rows = num_queries * G;  // row r = (query r / G, query head kv_head * G + r % G)
  const int64_t seq_len = seq_lens[item.seq];
  const int64_t first_pos = seq_len - query_lens[item.seq] + item.q_begin;
  const int64_t token0 = query_starts[item.seq] + item.q_begin;
  buf.reserve(rows, s);
  const BlockOps<float>& ops = block_ops<float>();
  const BlockOps<scalar_t>& in_place_ops = block_ops<scalar_t>();
  const int64_t value_rows_per_pass = rows_per_pass(s.num_vecs);
  const bool transposed = s.transposed_scores && rows >= kMinTransposedRows;
  // bfloat16 prompt tiles on AVX512-BF16 CPUs: keys and values as bfloat16 pairs into
  // vdpbf16ps (the probabilities rounded to bfloat16), no float32 copies.
#if defined(CARPOOL_AVX512_BF16)
  // (whole vector pairs only: the value sums take head_dim in pairs of vectors)
  const bool paired = std::is_same_v<scalar_t, at::BFloat16> && transposed && Dp == D &&
                      s.num_vecs % 2 == 0;
#else
  const bool paired = false;
#endif
  // Cache rows used as they are when they need no padding: float32 rows always; bfloat16/
  // float16 value rows when one register pass covers all rows (else each pass would convert
  // them again), and keys when one pass of the scores by row does.
  const bool keys_in_place =
      Dp == D && (is_float || (!transposed && rows <= kMaxRowScoreRows));
  const bool values_in_place = Dp == D && (is_float || rows <= value_rows_per_pass);

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = first_pos + r / G, head = item.kv_head * G + r % G;
    const scalar_t* q_row = q + (token0 + r / G) * s.q_token_stride + head * s.q_head_stride;
    float* qf = buf.queries.data() + r * Dp;
    if (paired) std::memcpy(buf.query_pairs.data() + r * D / 2, q_row, D * sizeof(scalar_t));
    to_float(q_row, qf, D);
    for (int64_t d = 0; d < D; ++d) qf[d] *= s.scale;
    buf.key_lo[r] = s.sliding_window > 0 ? std::max<int64_t>(0, pos - s.sliding_window + 1) : 0;
    buf.key_hi[r] = pos + 1;
    buf.row_max[r] = kNegInf;
    buf.row_sum[r] = 0.f;
  }
  std::fill(buf.acc.begin(), buf.acc.begin() + rows * Dp, 0.f);

  const auto [keys_begin, keys_end] = item_keys(s, item, query_lens, seq_lens);
  const int32_t* table = block_tables + item.seq * s.max_blocks;
  const int64_t head_stride = s.num_cache_blocks * BS * D;  // one head's blocks in the cache
  const scalar_t* key_head = cache + item.kv_head * head_stride;
  const scalar_t* value_head = cache + (s.num_kv_heads + item.kv_head) * head_stride;
  if (next != nullptr) {  // the first chunks of this thread's next item, while this one runs
    const auto [begin, end] = item_keys(s, *next, query_lens, seq_lens);
    const int64_t head_offset = next->kv_head * head_stride;
    prefetch_keys(s, block_tables + next->seq * s.max_blocks, cache + head_offset,
                  cache + s.num_kv_heads * head_stride + head_offset, begin,
                  std::min(end, begin / CK * CK + kPrefetchChunks * CK));
  }
  auto block_id = [&](int64_t b) {
    const int64_t block = table[b];
    TORCH_CHECK(block >= 0 && block < s.num_cache_blocks, "paged_attention: block id ", block,
                " of request ", item.seq, " is outside the cache (", s.num_cache_blocks, " blocks)");
    return block;
  };

  for (int64_t c0 = keys_begin / CK * CK; c0 < keys_end; c0 += CK) {
    // Keys [kb, ke) of the chunk (relative to c0) are loaded: those some row may attend.
    const int64_t kb = std::max(keys_begin, c0) - c0, ke = std::min(keys_end, c0 + CK) - c0;
    for (int64_t b = (c0 + kb) / BS; b * BS < c0 + ke; ++b) {
      const int64_t block = block_id(b);
      for (int64_t t = std::max(b * BS, c0 + kb) - c0; t < std::min((b + 1) * BS, c0 + ke) - c0; ++t) {
        const int64_t offset = (block * BS + (c0 + t) % BS) * D;
        buf.key_src[t] = key_head + offset;
        buf.value_src[t] = value_head + offset;
      }
    }
    // The rows two chunks ahead (the next one was asked for by the previous chunk, or before
    // the item began), while this one computes.
    const int64_t ahead = c0 + kPrefetchChunks * CK;
    prefetch_keys(s, table, key_head, value_head, ahead, std::min(keys_end, ahead + CK));
    const int64_t v_begin = kb / W, v_end = (ke + W - 1) / W;  // loaded key vectors
    for (int64_t t = v_begin * W; t < kb; ++t) buf.key_src[t] = buf.zeros_in_place.data();
    for (int64_t t = ke; t < v_end * W; ++t) buf.key_src[t] = buf.zeros_in_place.data();
    for (int64_t t = v_begin * W; t < v_end * W; ++t) {
      if constexpr (is_float) {
        if (keys_in_place) {
          buf.key_rows[t] = buf.key_src[t];
          continue;
        }
      } else {
        if (keys_in_place) continue;  // read through key_src
      }
      if (t < kb || t >= ke) {
        buf.key_rows[t] = buf.zeros.data();
        continue;
      }
      if (paired) continue;  // transposed below as bfloat16 pairs
      float* row = buf.keys.data() + t * Dp;
      to_float(buf.key_src[t], row, D);
      buf.key_rows[t] = row;
    }
    // Row r's allowed keys in the chunk, relative to c0 (empty when lo >= hi).
    auto row_lo = [&](int64_t r) { return std::max(buf.key_lo[r] - c0, kb); };
    auto row_hi = [&](int64_t r) { return std::min(buf.key_hi[r] - c0, ke); };
    // f(t, n) for the chunk's keys [kb, ke) in runs [t, t + n) within one cache block.
    auto for_each_block_run = [&](auto&& f) {
      for (int64_t t = kb; t < ke;) {
        const int64_t n = std::min(ke - t, BS - (c0 + t) % BS);
        f(t, n);
        t += n;
      }
    };
    // f(r0, n, j, kv) for each tile of n <= kMaxTransposedRows rows from r0 and kv key
    // vectors from vector j that some of those rows may attend.
    auto for_each_transposed_tile = [&](auto&& f) {
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxTransposedRows) {
        const int64_t n = std::min<int64_t>(kMaxTransposedRows, rows - r0);
        const int64_t lo = row_lo(r0), hi = row_hi(r0 + n - 1);  // rows in position order
        if (lo >= hi) continue;
        for (int64_t j = lo / W; j < (hi + W - 1) / W; j += kMaxKeyVecs) {
          f(r0, n, j, std::min<int64_t>(kMaxKeyVecs, (hi + W - 1) / W - j));
        }
      }
    };

    if (paired) {
#if defined(CARPOOL_AVX512_BF16)
      uint32_t* keys_p = reinterpret_cast<uint32_t*>(buf.keys_t.data());  // [D / 2][CS]
      for_each_block_run([&](int64_t t, int64_t n) {  // pairs moved as floats
        at::vec::transpose_mxn<float>(reinterpret_cast<const float*>(buf.key_src[t]), D / 2,
                                      reinterpret_cast<float*>(keys_p) + t, CS,
                                      static_cast<int>(n), static_cast<int>(D / 2));
      });
      for_each_transposed_tile([&](int64_t r0, int64_t n, int64_t j, int64_t kv) {
        pair_ops().scores[kv - 1][n - 1](buf.query_pairs.data() + r0 * D / 2, D / 2,
                                         keys_p + j * W, D / 2, s.scale,
                                         buf.scores.data() + r0 * CS + j * W, CS);
      });
#endif
    } else if (transposed) {
      for_each_block_run([&](int64_t t, int64_t n) {  // a constant row stride in a block
        transpose_keys(buf.key_rows[t], keys_in_place ? D : Dp, buf.keys_t.data() + t, CS, n, D);
      });
      for_each_transposed_tile([&](int64_t r0, int64_t n, int64_t j, int64_t kv) {
        ops.transposed[kv - 1][n - 1](buf.queries.data() + r0 * Dp, Dp,
                                      buf.keys_t.data() + j * W, D,
                                      buf.scores.data() + r0 * CS + j * W, CS);
      });
    } else {
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRowScoreRows) {
        const int64_t n = std::min<int64_t>(kMaxRowScoreRows, rows - r0);
        const int64_t lo = row_lo(r0), hi = row_hi(r0 + n - 1);  // rows in position order
        if (lo >= hi) continue;
        const float* queries = buf.queries.data() + r0 * Dp;
        float* scores = buf.scores.data() + r0 * CS;
        if (!is_float && keys_in_place) {
          in_place_ops.by_row[s.num_vecs - 1][n - 1](queries, Dp, buf.key_src.data(), lo / W,
                                                     (hi + W - 1) / W, scores, CS);
        } else {
          ops.by_row[s.num_vecs - 1][n - 1](queries, Dp, buf.key_rows.data(), lo / W,
                                            (hi + W - 1) / W, scores, CS);
        }
      }
    }
    bool any_row = false;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t lo = row_lo(r), hi = row_hi(r);
      float* sc = buf.scores.data() + r * CS;
      if (lo >= hi) {  // nothing allowed here: no change to the row
        std::fill(sc + v_begin * W, sc + v_end * W, 0.f);
        buf.correction[r] = 1.f;
        continue;
      }
      any_row = true;
      softmax_step(sc, lo, hi, v_begin, v_end, buf.row_max[r], buf.row_sum[r],
                   buf.correction[r]);
    }
    if (!any_row) continue;
#if defined(CARPOOL_AVX512_BF16)
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      if (paired) {
        for (int64_t u = kb / 2; 2 * u < ke; ++u) {  // keys 2u, 2u + 1 (zeros outside)
          const int64_t t = 2 * u;
          const scalar_t* a = t >= kb ? buf.value_src[t] : buf.zeros_in_place.data();
          const scalar_t* b = t + 1 < ke ? buf.value_src[t + 1] : buf.zeros_in_place.data();
          interleave_rows(a, b, buf.value_pairs.data() + u * Dp * 2, s.num_vecs);
        }
        for (int64_t r0 = 0; r0 < rows; r0 += value_rows_per_pass) {
          const int64_t n = std::min(value_rows_per_pass, rows - r0);
          const int64_t lo = row_lo(r0), hi = row_hi(r0 + n - 1);
          if (lo >= hi) continue;
          pair_ops().values[s.num_vecs / 2 - 1][n - 1](
              buf.scores.data() + r0 * CS, CS, buf.value_pairs.data(), lo / 2, (hi + 1) / 2,
              buf.correction.data() + r0, buf.acc.data() + r0 * Dp, Dp);
        }
        continue;
      }
    }
#endif
    for (int64_t t = kb; t < ke; ++t) {
      if constexpr (is_float) {
        if (values_in_place) {
          buf.value_rows[t] = buf.value_src[t];
          continue;
        }
      } else {
        if (values_in_place) continue;  // read through value_src
      }
      float* row = buf.values.data() + t * Dp;
      to_float(buf.value_src[t], row, D);
      buf.value_rows[t] = row;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += value_rows_per_pass) {
      const int64_t n = std::min(value_rows_per_pass, rows - r0);
      const int64_t lo = row_lo(r0), hi = row_hi(r0 + n - 1);
      if (lo >= hi) continue;
      const float* probs = buf.scores.data() + r0 * CS;
      float* acc = buf.acc.data() + r0 * Dp;
      if (!is_float && values_in_place) {
        in_place_ops.values[s.num_vecs - 1][n - 1](probs, CS, buf.value_src.data(), lo, hi,
                                                   buf.correction.data() + r0, acc, Dp);
      } else {
        ops.values[s.num_vecs - 1][n - 1](probs, CS, buf.value_rows.data(), lo, hi,
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

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// The element type the decode loops read a cache of scalar_t as (bfloat16 as its bits).
template <typename scalar_t>
using decode_elem_t =
    std::conditional_t<std::is_same_v<scalar_t, at::BFloat16>, uint16_t, scalar_t>;

// Whether the decode loops take single-query items of a scalar_t cache in this build (then
// also the head_dim must suit them: single_query_head_dim_ok).
template <typename scalar_t>
constexpr bool kDecodeLoops = std::is_same_v<scalar_t, float>
#if defined(CARPOOL_AVX512_BF16) || defined(CPU_CAPABILITY_AVX2)
                              || std::is_same_v<scalar_t, at::BFloat16>
#endif
    ;

// The arguments of attend_single_query for a single-query item.
template <typename scalar_t>
DecodeArgs<decode_elem_t<scalar_t>> decode_args(const Shapes& s, const WorkItem& item,
                                                const scalar_t* q, const scalar_t* cache,
                                                scalar_t* out, const int32_t* block_tables,
                                                const int32_t* query_starts,
                                                const int32_t* query_lens,
                                                const int32_t* seq_lens) {
  using elem_t = decode_elem_t<scalar_t>;
  const int64_t G = s.group_size, head_stride = s.num_cache_blocks * s.block_size * s.head_dim;
  const int64_t token = query_starts[item.seq] + item.q_begin;
  const auto [begin, end] = item_keys(s, item, query_lens, seq_lens);
  auto elems = [](auto* p) { return reinterpret_cast<elem_t*>(const_cast<scalar_t*>(p)); };
  return {elems(q + token * s.q_token_stride + item.kv_head * G * s.q_head_stride),
          s.q_head_stride,
          elems(cache + item.kv_head * head_stride),
          elems(cache + (s.num_kv_heads + item.kv_head) * head_stride),
          block_tables + item.seq * s.max_blocks,
          s.num_cache_blocks, s.block_size, s.head_dim, G, begin, end, s.scale,
          elems(out + token * s.out_token_stride + item.kv_head * G * s.out_head_stride),
          s.out_head_stride, item.seq};
}
#endif

// query_tile: kQueryTile, or 1 where every query row is to be its own single-query item.
std::vector<WorkItem> plan(const Shapes& s, const int32_t* query_lens, const int32_t* seq_lens,
                           int64_t num_seqs, int64_t query_tile) {
  std::vector<WorkItem> items;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_len = query_lens[i], seq_len = seq_lens[i];
    TORCH_CHECK(q_len >= 0 && q_len <= seq_len, "paged_attention: request ", i, " has query_len ",
                q_len, " and seq_len ", seq_len, " (need 0 <= query_len <= seq_len)");
    TORCH_CHECK(seq_len <= s.max_blocks * s.block_size, "paged_attention: request ", i,
                " has seq_len ", seq_len, " beyond its block table (", s.max_blocks, " blocks of ",
                s.block_size, ")");
    for (int64_t begin = 0; begin < q_len; begin += query_tile) {
      const int64_t end = std::min(q_len, begin + query_tile);
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
                     int64_t sliding_window, bool batch_invariant, int64_t bf16_widen) {
  TORCH_CHECK(bf16_widen >= -1 && bf16_widen <= 1,
              "paged_attention: bf16_widen must be -1 (this CPU's choice), 0 or 1, got ",
              bf16_widen);
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
  s.chunk_keys = std::max<int64_t>(1, kChunkKeys / s.block_size) * s.block_size;
  s.chunk_stride = round_up(s.chunk_keys, Vec::size());
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  s.transposed_scores = !batch_invariant;
#else
  s.transposed_scores = false;  // transpose_keys is scalar below AVX2
#endif

  const int32_t* starts = query_starts.data_ptr<int32_t>();
  const int32_t* q_lens = query_lens.data_ptr<int32_t>();
  const int32_t* s_lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK(starts[i] >= 0 && starts[i] + q_lens[i] <= q.size(0), "paged_attention: request ",
                i, "'s query rows fall outside q");
  }
  auto run = [&](auto dtype_tag) {
    using scalar_t = decltype(dtype_tag);
    const scalar_t* q_ptr = q.const_data_ptr<scalar_t>();
    const scalar_t* cache_ptr = kv_cache.const_data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    // Single-query items (decodes) take the decode loops where they take the dtype and
    // head_dim. In the batch-invariant mode a position's arithmetic may not depend on whether
    // it was scheduled alone or in a chunk, so there every query row is its own
    // single-query item, on the decode loops too; where they do not apply, every row takes
    // attend_item's tiles, scored by row.
    bool decode_loops = false;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if constexpr (kDecodeLoops<scalar_t>) {
      decode_loops = single_query_head_dim_ok<decode_elem_t<scalar_t>>(s.head_dim);
    }
#endif
    const std::vector<WorkItem> items =
        plan(s, q_lens, s_lens, num_seqs, batch_invariant && decode_loops ? 1 : kQueryTile);
    if (items.empty()) return;
    std::atomic<int64_t> next{0};
    const int64_t num_items = static_cast<int64_t>(items.size());
    const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), num_items);
    at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
      Scratch<scalar_t> buf;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
      DecodeScratch decode_buf;
      decode_buf.widen_bf16 = static_cast<int>(bf16_widen);
#endif
      // Each thread claims its next item before attending the current one, to prefetch it.
      for (int64_t i = next.fetch_add(1); i < num_items;) {
        const int64_t j = next.fetch_add(1);
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
        if constexpr (kDecodeLoops<scalar_t>) {
          if (decode_loops && items[i].q_end - items[i].q_begin == 1) {
            using Args = DecodeArgs<decode_elem_t<scalar_t>>;
            const bool next_decode = j < num_items && items[j].q_end - items[j].q_begin == 1;
            const Args next_args = next_decode ? decode_args(s, items[j], q_ptr, cache_ptr,
                                                             out_ptr, tables, starts, q_lens,
                                                             s_lens)
                                               : Args{};
            attend_single_query(decode_args(s, items[i], q_ptr, cache_ptr, out_ptr, tables,
                                            starts, q_lens, s_lens),
                                next_decode ? &next_args : nullptr, decode_buf);
            i = j;
            continue;
          }
        }
#endif
        attend_item<scalar_t>(s, items[i], q_ptr, cache_ptr, out_ptr, tables, starts, q_lens,
                              s_lens, j < num_items ? &items[j] : nullptr, buf);
        i = j;
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
