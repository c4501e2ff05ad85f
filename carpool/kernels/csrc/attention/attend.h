// The one attention entry of a CPU step: the Python kernels backend (attention/cpu_kernel.py)
// and the layer stack (layers/layer_stack.cpp) both call `attend`, so the two cannot route a
// row differently.
//
// A step's requests arrive split in two by the backend's metadata, as the route decided at
// load (carpool/platform/cpu_route.py): the rows prefill_attention_bf16 takes (bfloat16 prompt
// chunks, where the CPU has AVX512-BF16) and the rows paged_attention takes (every other one:
// decodes, and prompt chunks where the prefill kernel does not run). Either list is empty or
// the four int32 tensors block_tables, query_starts, query_lens, seq_lens; between them they
// cover every row of q, so `out` is allocated without zeroing.
//
// Inline in this header: each caller's translation unit gets it, no build list to extend.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <vector>

#include "kernel_api.h"

namespace carpool_attention {

namespace attend_detail {

// Four int32 row tensors (KernelRows' fields), or none.
inline bool has_rows(const std::vector<at::Tensor>& rows, const char* name) {
  TORCH_CHECK(rows.empty() || rows.size() == 4, "attend: ", name,
              " must be empty or [block_tables, query_starts, query_lens, seq_lens]");
  return !rows.empty();
}

}  // namespace attend_detail

// The step's attention into a new [T, H, D]: prompt chunks to prefill_attention_bf16, the
// other rows to paged_attention (each list empty or [block_tables, query_starts, query_lens,
// seq_lens]).
inline at::Tensor attend(const at::Tensor& q, const at::Tensor& kv_cache,
                         const std::vector<at::Tensor>& paged_rows,
                         const std::vector<at::Tensor>& prefill_rows, double scale,
                         int64_t sliding_window, bool prefill_amx, bool batch_invariant) {
  const bool paged = attend_detail::has_rows(paged_rows, "paged_rows");
  const bool prefill = attend_detail::has_rows(prefill_rows, "prefill_rows");
  TORCH_CHECK(paged || prefill, "attend: a step has rows for paged_attention, "
              "prefill_attention_bf16 or both");
  at::Tensor out = at::empty_like(q);
  if (prefill) {
    carpool_prefill::prefill_attention_bf16(out, q, kv_cache, prefill_rows[0], prefill_rows[1],
                                            prefill_rows[2], prefill_rows[3], scale,
                                            prefill_amx);
  }
  if (paged) {
    paged_attention(out, q, kv_cache, paged_rows[0], paged_rows[1], paged_rows[2],
                    paged_rows[3], scale, sliding_window, batch_invariant, /*bf16_widen=*/-1);
  }
  return out;
}

}  // namespace carpool_attention
