// Causal attention of bfloat16 prompt chunks, with both products on AVX512-BF16 `vdpbf16ps`,
// as small matrix multiplications.
//
// prefill_attention_bf16(out, q, kv_cache, block_tables, query_starts, query_lens, seq_lens,
// scale): paged_attention's arguments (no sliding window). Request i's queries are rows
// query_starts[i] + j, j < query_lens[i], of q [T, H, D] at positions
// seq_lens[i] - query_lens[i] + j, attending the keys at positions <= their own, read from
// kv_cache [2, Hkv, num_blocks, block_size, D] (this step's already written) through the
// block table: a fresh prompt, or a chunk after cached tokens (an earlier chunk, a prefix-
// cache hit). out [T, H, D] gets those rows. D a multiple of 16 (`prefill_head_dim_ok`).
//
// First every (request, kv head)'s keys and values are packed once into the pair layout
// `vdpbf16ps` reads (as small_gemm.cpp packs a weight): keys as 16-key blocks of
// (d, d + 1) pairs, so scores = Q . K^T is a GEMM over head_dim; values as rows of
// (key, key + 1) pairs, 16 columns per block, so out = P . V is a GEMM over keys. Both
// layouts run along the keys, so a request whose block table starts with another's blocks
// (prompts sharing a cached prefix; in the step that computes it, too) reads that packing
// for those keys, in whole 64-key chunks, and packs only the rest (`find_shared_prefixes`):
// 16 chunks sharing 768 tokens pack them once, not 16 times. The buffers are kept from call
// to call. Then a work item is
// (request, kv head, block of kQueryBlock queries); its rows are the queries times the
// G = H / Hkv query heads sharing the kv head. It walks the keys up to its last query in
// chunks of kKeyChunk: scores in float32, the causal mask, an online softmax per row
// (running max and sum, the output accumulator rescaled), the probabilities rounded to
// bfloat16 (as bfloat16 SDPA kernels do) for the second product. Threads take items
// dynamically, longest first.
//
// With amx (builds for CPUs with AMX, carpool/kernels/loader.py's -DCARPOOL_AMX; head_dim a multiple of
// 32) both products run on the tile unit instead, on 16-row tiles (rows padded with zeros):
// the packed layouts are already its B operands. Prompts are packed to whole 64-key chunks
// so the value tiles' 32-key groups never read past a prompt's buffer. The softmax is the
// same code either way.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <vector>

#include "gemm/bf16_dot.h"
#include "runtime/line_aligned.h"

#include "gemm/amx_tiles.h"

namespace carpool_prefill {

namespace {

constexpr int64_t kBlock = 16;        // keys per score block / head_dim columns per block
constexpr int64_t kQueryBlock = 32;   // queries per work item
constexpr int64_t kKeyChunk = 64;     // keys per online-softmax step (4 blocks)
constexpr int kScoreRows = 12;        // rows per score tile (x 2 key blocks)
constexpr int kValueRows = 6;         // rows per value tile (x 4 head_dim blocks)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kMaxSlack = 8.f;      // how far a score may pass a row's running max

struct Item {
  int64_t request, kv_head, q_begin, q_end, cost;  // queries relative to the request
};

#if defined(CPU_CAPABILITY_AVX512)
// scores[r][0..kKeyChunk) = q[r] . keys of the chunk (nblocks 16-key blocks), R rows.
template <int R>
CARPOOL_BF16_TARGET void score_rows(const uint16_t* q, int64_t q_stride, const uint16_t* kp,
                                    int64_t k_block_stride, int64_t d_pairs, int64_t nblocks,
                                    float* scores) {
  for (int64_t b0 = 0; b0 < nblocks; b0 += 2) {
    if (b0 + 2 <= nblocks) {
      __m512 acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      bf16_dot_tile<R, 2>(q, q_stride, kp + b0 * k_block_stride, k_block_stride, d_pairs, acc);
      for (int r = 0; r < R; ++r) {
        _mm512_storeu_ps(scores + r * kKeyChunk + b0 * kBlock, acc[r][0]);
        _mm512_storeu_ps(scores + r * kKeyChunk + (b0 + 1) * kBlock, acc[r][1]);
      }
    } else {
      __m512 acc[R][1];
      for (int r = 0; r < R; ++r) acc[r][0] = _mm512_setzero_ps();
      bf16_dot_tile<R, 1>(q, q_stride, kp + b0 * k_block_stride, k_block_stride, d_pairs, acc);
      for (int r = 0; r < R; ++r) _mm512_storeu_ps(scores + r * kKeyChunk + b0 * kBlock, acc[r][0]);
    }
  }
}

// o[r][0..D) = o[r] * correction[r] + p[r] . V chunk (key pairs), R rows, D / 16 blocks.
// The chunk's values are rows of 2 * D per key pair ([key pair][d block][16][2]).
template <int R>
CARPOOL_BF16_TARGET void value_rows(const uint16_t* p, const uint16_t* vp, int64_t key_pairs,
                                    int64_t d_blocks, const float* correction, float* o,
                                    int64_t o_stride) {
  const int64_t v_block_stride = 2 * kBlock, pair_stride = d_blocks * 2 * kBlock;
  for (int64_t b0 = 0; b0 < d_blocks; b0 += 4) {
    const int64_t nb = std::min<int64_t>(4, d_blocks - b0);
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r) {
      const __m512 c = _mm512_set1_ps(correction[r]);
      for (int b = 0; b < 4; ++b) {
        acc[r][b] = b < nb ? _mm512_mul_ps(_mm512_loadu_ps(o + r * o_stride + (b0 + b) * kBlock), c)
                           : _mm512_setzero_ps();
      }
    }
    if (nb == 4) {
      bf16_dot_tile<R, 4>(p, kKeyChunk, vp + b0 * v_block_stride, v_block_stride, key_pairs, acc,
                          pair_stride);
    } else {
      for (int64_t b = 0; b < nb; ++b) {
        __m512 one[R][1];
        for (int r = 0; r < R; ++r) one[r][0] = acc[r][b];
        bf16_dot_tile<R, 1>(p, kKeyChunk, vp + (b0 + b) * v_block_stride, v_block_stride, key_pairs,
                            one, pair_stride);
        for (int r = 0; r < R; ++r) acc[r][b] = one[r][0];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int64_t b = 0; b < nb; ++b) _mm512_storeu_ps(o + r * o_stride + (b0 + b) * kBlock, acc[r][b]);
    }
  }
}

// e^x for the softmax's probabilities (x <= kMaxSlack, or -inf), in about half of exp_u20's
// instructions: 2^t for t = x log2(e) as 2^f 2^n, n = t rounded, f in [-1/2, 1/2], 2^f by a
// degree-5 polynomial (fitted for relative error, at most 3.5e-7 on that range), 2^n applied
// by vscalefps. t is clamped at -125 so that no result is a denormal (each would cost a
// microcode assist), and x below -87 (e^x under float's smallest normal; -inf for masked
// keys) gives 0, as exp_u20 does. The probabilities are rounded to bfloat16 (steps of 2^-8)
// right after, so the two exps' results round alike but where one lands within a few 1e-7
// of a rounding boundary.
CARPOOL_BF16_TARGET inline __m512 exp_probability(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GT_OQ);
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                 _mm512_set1_ps(-125.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.0012915669940412045f), f,
                             _mm512_set1_ps(0.009668530896306038f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.055516887456178665f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022264778614044f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931464672088623f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

// One row's online-softmax step over a key chunk: its kKeyChunk raw scores at sc (the first
// `allowed` > 0 attended, the rest masked), scaled, against the row's running max m and its
// vector of partial sums at sum; the probabilities, rounded to bfloat16 (as bfloat16 SDPA
// kernels round them for the second product), into pr. Returns the factor the row's output
// accumulator must be multiplied by first (1: unchanged). The max is lazy, as the decode
// loop's (decode_one_pass.h): it moves only when a score passes it by more than kMaxSlack, so
// most chunks skip the horizontal max, the exp of the correction and the rescale (the slack
// cancels in the final division; probabilities stay below e^kMaxSlack). The scores stay in
// registers, and the sums in a vector (summed once, at the end): the rounded probabilities,
// which the value product uses.
CARPOOL_BF16_TARGET inline float softmax_chunk(const float* sc, int64_t allowed, float scale,
                                               float& m, float* sum, uint16_t* pr) {
  constexpr int kVecs = kKeyChunk / kBlock;
  __m512 x[kVecs];
  __mmask16 passes = 0;
  const __m512 threshold = _mm512_set1_ps(m + kMaxSlack);
  for (int t = 0; t < kVecs; ++t) {
    const int64_t left = allowed - t * kBlock;
    const __mmask16 live = left <= 0 ? 0 : left >= kBlock ? 0xFFFF
                                     : static_cast<__mmask16>((1u << left) - 1);
    x[t] = _mm512_mask_mul_ps(_mm512_set1_ps(kNegInf), live, _mm512_loadu_ps(sc + t * kBlock),
                              _mm512_set1_ps(scale));
    passes |= _mm512_cmp_ps_mask(x[t], threshold, _CMP_GT_OQ);
  }
  float correction = 1.f;
  if (passes) {  // always while m is -inf: some key is attended
    const float chunk_max = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3])));
    correction = m == kNegInf ? 1.f : std::exp(m - chunk_max);  // first: all still zero
    m = chunk_max;  // above m + kMaxSlack
  }
  const __m512 shift = _mm512_set1_ps(m);
  __m512 total = _mm512_mul_ps(_mm512_loadu_ps(sum), _mm512_set1_ps(correction));
  for (int t = 0; t < kVecs; ++t) {
    // exp(x - max) with x = -inf -> 0
    const __m512 e = exp_probability(_mm512_sub_ps(x[t], shift));
    const __m256i pb = (__m256i)_mm512_cvtneps_pbh(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + t * kBlock), pb);
    total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16)));
  }
  _mm512_storeu_ps(sum, total);
  return correction;
}

#if defined(CARPOOL_AMX)
// AMX (the tile unit of Intel Sapphire Rapids and later): the same two products on 16-row
// tiles, from the same packed layouts, which are exactly the tile unit's B operands: keys as
// (d, d + 1) pairs of 16 keys (64 bytes a pair row), values as (key, key + 1) pairs of 16
// columns. A is 16 rows of 32 bfloat16 (queries; probabilities), C 16 x 16 float32.

// scores[r][0..16 * nblocks) = q[r] . keys of the chunk for 16 rows (q row stride D).
CARPOOL_AMX_TARGET void amx_score_tile(const uint16_t* q, int64_t D, const uint16_t* kp,
                                       int64_t k_block_stride, int64_t nblocks, float* scores) {
  for (int64_t b = 0; b < nblocks; ++b) {
    _tile_zero(2);
    for (int64_t j = 0; j < D / 32; ++j) {
      _tile_loadd(0, q + 32 * j, D * sizeof(uint16_t));
      _tile_loadd(1, kp + b * k_block_stride + j * 16 * 2 * kBlock, 64);
      _tile_dpbf16ps(2, 0, 1);
    }
    _tile_stored(2, scores + b * kBlock, kKeyChunk * sizeof(float));
  }
}

// o[r] += p[r] . V chunk for 16 rows: key_groups groups of 32 keys, d_blocks of 16 columns;
// a B tile is 16 key pairs' rows of one d block, 2 * D values apart.
CARPOOL_AMX_TARGET void amx_value_tile(const uint16_t* p, const uint16_t* vchunk,
                                       int64_t key_groups, int64_t d_blocks, float* o,
                                       int64_t D) {
  for (int64_t b = 0; b < d_blocks; ++b) {
    _tile_loadd(2, o + b * kBlock, D * sizeof(float));
    for (int64_t j = 0; j < key_groups; ++j) {
      _tile_loadd(0, p + 32 * j, kKeyChunk * sizeof(uint16_t));
      _tile_loadd(1, vchunk + j * 16 * 2 * D + b * 2 * kBlock, 2 * D * sizeof(uint16_t));
      _tile_dpbf16ps(2, 0, 1);
    }
    _tile_stored(2, o + b * kBlock, D * sizeof(float));
  }
}
#endif

struct Shapes {
  int64_t num_heads, num_kv_heads, group, head_dim, d_pairs, d_blocks;
  float scale;
};

// kp, vp: this (request, kv head)'s packed keys and values; keys below `shared_keys` (whole
// key chunks) are read from another request's, k_shared and v_shared (same blocks).
CARPOOL_BF16_TARGET void attend_item(const Shapes& s, const Item& item, const uint16_t* q,
                                     int64_t q_tok, int64_t q_head, const uint16_t* kp,
                                     const uint16_t* vp, const uint16_t* k_shared,
                                     const uint16_t* v_shared, int64_t shared_keys,
                                     int64_t start, int64_t first_pos, uint16_t* out,
                                     int64_t o_tok, int64_t o_head, bool amx) {
  const int64_t G = s.group, D = s.head_dim;
  const int64_t nq = item.q_end - item.q_begin, rows = nq * G;
  const int64_t padded_rows = amx ? (rows + 15) / 16 * 16 : rows;  // whole tiles (zeros)
  thread_local LineVector<uint16_t> qbuf, pbuf;
  thread_local LineVector<float> scores, obuf, row_max, row_sum, corr;
  qbuf.resize(padded_rows * D);
  std::fill(qbuf.begin() + rows * D, qbuf.begin() + padded_rows * D, 0);
  pbuf.resize(padded_rows * kKeyChunk);
  std::fill(pbuf.begin() + rows * kKeyChunk, pbuf.begin() + padded_rows * kKeyChunk, 0);
  scores.resize(padded_rows * kKeyChunk);
  obuf.assign(padded_rows * D, 0.f);
  row_max.assign(rows, kNegInf);
  row_sum.assign(rows * kBlock, 0.f);  // a vector of partial sums a row
  corr.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = start + item.q_begin + r / G, head = item.kv_head * G + r % G;
    std::memcpy(qbuf.data() + r * D, q + tok * q_tok + head * q_head, D * sizeof(uint16_t));
  }
  const int64_t k_block_stride = s.d_pairs * 2 * kBlock;  // one 16-key block of keys
  const int64_t keys_end = first_pos + item.q_end;  // keys [0, the last query's position]
  for (int64_t c0 = 0; c0 < keys_end; c0 += kKeyChunk) {
    const int64_t chunk_keys = std::min(kKeyChunk, keys_end - c0);
    const int64_t nblocks = (chunk_keys + kBlock - 1) / kBlock;
    const uint16_t* kchunk = (c0 < shared_keys ? k_shared : kp) + (c0 / kBlock) * k_block_stride;
    const uint16_t* vchunk = (c0 < shared_keys ? v_shared : vp) + (c0 / 2) * 2 * D;
#if defined(CARPOOL_AMX)
    if (amx) {
      for (int64_t r0 = 0; r0 < padded_rows; r0 += 16) {
        amx_score_tile(qbuf.data() + r0 * D, D, kchunk, k_block_stride, nblocks,
                       scores.data() + r0 * kKeyChunk);
      }
    }
#endif
    for (int64_t r0 = 0; !amx && r0 < rows; r0 += kScoreRows) {
      const int64_t n = std::min<int64_t>(kScoreRows, rows - r0);
      const uint16_t* qa = qbuf.data() + r0 * D;
      const uint16_t* kb = kchunk;
      float* sc = scores.data() + r0 * kKeyChunk;
      switch (n) {
#define CARPOOL_SCORE(R) case R: score_rows<R>(qa, D, kb, k_block_stride, s.d_pairs, nblocks, sc); break;
        CARPOOL_SCORE(1) CARPOOL_SCORE(2) CARPOOL_SCORE(3) CARPOOL_SCORE(4) CARPOOL_SCORE(5)
        CARPOOL_SCORE(6) CARPOOL_SCORE(7) CARPOOL_SCORE(8) CARPOOL_SCORE(9) CARPOOL_SCORE(10)
        CARPOOL_SCORE(11) CARPOOL_SCORE(12)
#undef CARPOOL_SCORE
      }
    }
    // Online softmax per row; keys past the row's position (and past the chunk) masked.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + item.q_begin + r / G;
      const int64_t allowed = std::min<int64_t>(chunk_keys, pos - c0 + 1);  // may be <= 0
      uint16_t* pr = pbuf.data() + r * kKeyChunk;
      if (allowed <= 0) {
        std::memset(pr, 0, kKeyChunk * sizeof(uint16_t));
        corr[r] = 1.f;
        continue;
      }
      corr[r] = softmax_chunk(scores.data() + r * kKeyChunk, allowed, s.scale, row_max[r],
                              row_sum.data() + r * kBlock, pr);
    }
    const int64_t key_pairs = (nblocks * kBlock) / 2;
#if defined(CARPOOL_AMX)
    if (amx) {
      for (int64_t r = 0; r < rows; ++r) {  // rescale, then the tiles add P . V
        if (corr[r] == 1.f) continue;
        const __m512 c = _mm512_set1_ps(corr[r]);
        for (int64_t d = 0; d < D; d += kBlock) {
          _mm512_storeu_ps(obuf.data() + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(obuf.data() + r * D + d), c));
        }
      }
      for (int64_t r0 = 0; r0 < padded_rows; r0 += 16) {
        amx_value_tile(pbuf.data() + r0 * kKeyChunk, vchunk, (chunk_keys + 31) / 32,
                       s.d_blocks, obuf.data() + r0 * D, D);
      }
    }
#endif
    for (int64_t r0 = 0; !amx && r0 < rows; r0 += kValueRows) {
      const int64_t n = std::min<int64_t>(kValueRows, rows - r0);
      const uint16_t* pa = pbuf.data() + r0 * kKeyChunk;
      float* o = obuf.data() + r0 * D;
      switch (n) {
#define CARPOOL_VALUE(R) case R: value_rows<R>(pa, vchunk, key_pairs, s.d_blocks, corr.data() + r0, o, D); break;
        CARPOOL_VALUE(1) CARPOOL_VALUE(2) CARPOOL_VALUE(3) CARPOOL_VALUE(4) CARPOOL_VALUE(5) CARPOOL_VALUE(6)
#undef CARPOOL_VALUE
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = start + item.q_begin + r / G, head = item.kv_head * G + r % G;
    uint16_t* dst = out + tok * o_tok + head * o_head;
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(row_sum.data() + r * kBlock)));
    for (int64_t d = 0; d < D; d += kBlock) {
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(obuf.data() + r * D + d), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)v);
    }
  }
}
// One (request, kv head)'s keys [begin, len) into [key block][d pair][16 keys][2] (begin a
// multiple of 16; the buffer holds `padded` keys, those from len on zeroed): each 16-key
// block is a transpose of 16 rows of D / 2 pairs, one 16-lane gather per pair where the
// 16 keys are one cache block's consecutive rows (block_size a multiple of 16: the usual
// case), else key by key.
template <typename RowFn>
CARPOOL_BF16_TARGET void pack_keys(const RowFn& row, int64_t begin, int64_t len, int64_t padded,
                                   int64_t block_size, int64_t D, uint16_t* kp) {
  const int64_t block_values = (D / 2) * 2 * kBlock;
  const __m512i lanes = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(D / 2)));  // key k's first pair, in 32-bit units
  for (int64_t t0 = begin; t0 < len; t0 += kBlock) {
    const int64_t n = std::min<int64_t>(kBlock, len - t0);
    uint16_t* dst = kp + (t0 / kBlock) * block_values;
    if (block_size % kBlock == 0) {  // keys t0 .. t0 + 15 are consecutive rows of one block
      const int* base = reinterpret_cast<const int*>(row(t0, 0));
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
      for (int64_t p = 0; p < D / 2; ++p) {
        const __m512i pairs = _mm512_mask_i32gather_epi32(
            _mm512_setzero_si512(), valid, _mm512_add_epi32(lanes, _mm512_set1_epi32(p)), base, 4);
        _mm512_storeu_si512(dst + p * 2 * kBlock, pairs);
      }
      continue;
    }
    if (n < kBlock) std::memset(dst, 0, block_values * sizeof(uint16_t));
    for (int64_t k = 0; k < n; ++k) {
      const uint32_t* pairs = reinterpret_cast<const uint32_t*>(row(t0 + k, 0));
      uint32_t* out = reinterpret_cast<uint32_t*>(dst) + k;
      for (int64_t p = 0; p < D / 2; ++p) out[p * kBlock] = pairs[p];
    }
  }
  const int64_t first_unused = (len + kBlock - 1) / kBlock * block_values;
  std::memset(kp + first_unused, 0, (padded / kBlock * block_values - first_unused) * sizeof(uint16_t));
}

// One (request, kv head)'s values [begin, len) into [key pair][d block][16 d][2] (begin even;
// `padded` keys, the pairs past len zeroed): per pair of positions, each 16 columns of the
// two rows interleaved by one permute. A last odd position pairs with zeros.
template <typename RowFn>
CARPOOL_BF16_TARGET void pack_values(const RowFn& row, int64_t begin, int64_t len,
                                     int64_t padded, int64_t D, uint16_t* vp) {
  alignas(64) static constexpr uint16_t kInterleave[32] = {
      0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int64_t t = begin; t < len; t += 2) {
    const uint16_t* a = row(t, 1);
    const uint16_t* b = t + 1 < len ? row(t + 1, 1) : nullptr;
    uint16_t* dst = vp + (t / 2) * 2 * D;
    for (int64_t d = 0; d < D; d += kBlock) {
      const __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d)));
      const __m512i y = b == nullptr ? _mm512_setzero_si512() : _mm512_castsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d)));
      _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(x, interleave, y));
    }
  }
  const int64_t used_pairs = (len + 1) / 2;
  std::memset(vp + used_pairs * 2 * D, 0, (padded / 2 - used_pairs) * 2 * D * sizeof(uint16_t));
}

// The leading keys each request can read from another's packed buffers instead of packing
// them again: the longest run of whole key chunks whose cache blocks equal, position by
// position, those of an earlier request that packs its own from position 0 (prompts sharing
// a cached prefix, or hitting what another computes in this step). Blocks are equal only
// with equal contents, so any such request's packing serves.
struct SharedPrefix {
  std::vector<int64_t> owner;  // per request: whose buffers it reads first (-1: none)
  std::vector<int64_t> keys;   // per request: how many keys it reads there (whole chunks)
};

inline SharedPrefix find_shared_prefixes(const int32_t* tables, int64_t max_blocks,
                                         int64_t block_size, const int32_t* qlen,
                                         const int32_t* slen, int64_t num_requests) {
  SharedPrefix shared{std::vector<int64_t>(num_requests, -1), std::vector<int64_t>(num_requests, 0)};
  std::unordered_map<int32_t, std::vector<int64_t>> owners;  // first block -> requests
  for (int64_t i = 0; i < num_requests; ++i) {
    if (qlen[i] == 0 || slen[i] == 0) continue;
    const int32_t* row = tables + i * max_blocks;
    std::vector<int64_t>& candidates = owners[row[0]];
    for (int64_t j : candidates) {
      const int32_t* other = tables + j * max_blocks;
      const int64_t limit = std::min(slen[i], slen[j]);
      int64_t b = 0;
      while (b * block_size < limit && row[b] == other[b]) ++b;
      const int64_t keys = std::min(b * block_size, limit) / kKeyChunk * kKeyChunk;
      if (keys > shared.keys[i]) {
        shared.keys[i] = keys;
        shared.owner[i] = j;
      }
    }
    if (shared.owner[i] < 0) candidates.push_back(i);
  }
  return shared;
}
#endif

}  // namespace

bool prefill_head_dim_ok(int64_t head_dim) { return head_dim % kBlock == 0 && head_dim <= 256; }

void prefill_attention_bf16(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& query_starts,
                            const at::Tensor& query_lens, const at::Tensor& seq_lens,
                            double scale, bool amx) {
#if defined(CPU_CAPABILITY_AVX512)
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "prefill_attention_bf16: no AVX512-BF16");
  TORCH_CHECK(!amx || (amx_usable() && q.size(2) % 32 == 0), "prefill_attention_bf16: "
              "amx needs a build and CPU with AMX (has_amx) and head_dim a multiple of 32");
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&out), &q}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->dim() == 3 &&
                    t->stride(2) == 1,
                "prefill_attention_bf16: out and q must be bfloat16 CPU [T, H, D] with head_dim "
                "contiguous");
  }
  TORCH_CHECK(out.sizes() == q.sizes(), "prefill_attention_bf16: out and q differ in shape");
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.scalar_type() == at::kBFloat16 &&
                  kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.size(4) == q.size(2) && q.size(1) % kv_cache.size(1) == 0,
              "prefill_attention_bf16: kv_cache must be a contiguous bfloat16 "
              "[2, Hkv, num_blocks, block_size, D] matching q");
  TORCH_CHECK(prefill_head_dim_ok(q.size(2)), "prefill_attention_bf16: head_dim ", q.size(2),
              " is not a multiple of 16 up to 256");
  for (const at::Tensor* t : {&query_starts, &query_lens, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->dim() == 1 && t->is_contiguous() &&
                    t->size(0) == block_tables.size(0),
                "prefill_attention_bf16: query_starts, query_lens, seq_lens must be contiguous "
                "int32 [S]");
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.is_contiguous(),
              "prefill_attention_bf16: block_tables must be a contiguous int32 [S, max_blocks]");
  Shapes s;
  s.num_heads = q.size(1);
  s.num_kv_heads = kv_cache.size(1);
  s.group = s.num_heads / s.num_kv_heads;
  s.head_dim = q.size(2);
  s.d_pairs = s.head_dim / 2;
  s.d_blocks = s.head_dim / kBlock;
  s.scale = static_cast<float>(scale);
  const int64_t num_requests = block_tables.size(0), D = s.head_dim, Hkv = s.num_kv_heads;
  const int64_t num_cache_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* st = query_starts.const_data_ptr<int32_t>();
  const int32_t* qlen = query_lens.const_data_ptr<int32_t>();
  const int32_t* slen = seq_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  // Per (request, kv head): padded_keys * D values in each of the two packed buffers.
  std::vector<int64_t> offset(num_requests * Hkv + 1, 0), blocks(num_requests);
  std::vector<Item> items;
  for (int64_t i = 0; i < num_requests; ++i) {
    TORCH_CHECK(qlen[i] >= 0 && qlen[i] <= slen[i] && st[i] >= 0 && st[i] + qlen[i] <= q.size(0),
                "prefill_attention_bf16: request ", i, "'s query rows fall outside q or exceed "
                "its seq_len");
    TORCH_CHECK(slen[i] <= max_blocks * block_size, "prefill_attention_bf16: request ", i,
                " has seq_len ", slen[i], " beyond its block table");
    for (int64_t b = 0; b * block_size < slen[i]; ++b) {
      const int64_t block = tables[i * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_cache_blocks, "prefill_attention_bf16: block id ",
                  block, " of request ", i, " is outside the cache (", num_cache_blocks,
                  " blocks)");
    }
    // whole key chunks: the tiles read 32-key groups of values up to the chunk's end
    blocks[i] = (slen[i] + kKeyChunk - 1) / kKeyChunk * (kKeyChunk / kBlock);
    for (int64_t h = 0; h < Hkv; ++h) {
      offset[i * Hkv + h + 1] = offset[i * Hkv + h] + blocks[i] * kBlock * D;
      for (int64_t b = 0; b < qlen[i]; b += kQueryBlock) {
        const int64_t e = std::min<int64_t>(qlen[i], b + kQueryBlock);
        items.push_back({i, h, b, e, (slen[i] - qlen[i] + e) * (e - b)});
      }
    }
  }
  if (items.empty()) return;
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  // The packed buffers are kept from call to call (per calling thread): every value read is
  // written first (tails zeroed), so they need no clearing.
  thread_local LineVector<uint16_t> k_packed, v_packed;
  if (static_cast<int64_t>(k_packed.size()) < offset.back()) {
    k_packed.resize(offset.back());
    v_packed.resize(offset.back());
  }
  const SharedPrefix shared = find_shared_prefixes(tables, max_blocks, block_size, qlen, slen,
                                                   num_requests);
  const uint16_t* qd = reinterpret_cast<const uint16_t*>(q.const_data_ptr());
  const uint16_t* cache = reinterpret_cast<const uint16_t*>(kv_cache.const_data_ptr());
  uint16_t* od = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t head_stride = num_cache_blocks * block_size * D;  // one head's blocks
  // Pack keys as [key block][d pair][16 keys][2] and values as [key pair][d block][16 d][2],
  // each request from the end of the prefix it reads from another's.
  uint16_t* kbuf = k_packed.data();
  uint16_t* vbuf = v_packed.data();
  at::parallel_for(0, num_requests * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ih = begin; ih < end; ++ih) {
      const int64_t i = ih / Hkv, h = ih % Hkv;
      if (qlen[i] == 0) continue;
      auto row = [&](int64_t t, int64_t kv) {  // position t's key (kv 0) or value (1) row
        const int64_t slot = tables[i * max_blocks + t / block_size] * block_size + t % block_size;
        return cache + (kv * Hkv + h) * head_stride + slot * D;
      };
      const int64_t padded = blocks[i] * kBlock;
      pack_keys(row, shared.keys[i], slen[i], padded, block_size, D, kbuf + offset[ih]);
      pack_values(row, shared.keys[i], slen[i], padded, D, vbuf + offset[ih]);
    }
  });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
#if defined(CARPOOL_AMX)
    if (amx) configure_tiles();
#endif
    for (int64_t n = next.fetch_add(1); n < num_items; n = next.fetch_add(1)) {
      const Item& it = items[n];
      const int64_t own = offset[it.request * Hkv + it.kv_head];
      const int64_t owner = shared.owner[it.request];
      const int64_t theirs = owner < 0 ? own : offset[owner * Hkv + it.kv_head];
      attend_item(s, it, qd, q.stride(0), q.stride(1), kbuf + own, vbuf + own, kbuf + theirs,
                  vbuf + theirs, shared.keys[it.request], st[it.request],
                  slen[it.request] - qlen[it.request], od, out.stride(0), out.stride(1), amx);
    }
#if defined(CARPOOL_AMX)
    if (amx) release_tiles();
#endif
  });
#else
  TORCH_CHECK(false, "prefill_attention_bf16: built without AVX512");
#endif
}

}  // namespace carpool_prefill
