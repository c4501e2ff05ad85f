"""The CPU backend: the paths that beat SDPA's CPU kernels on this hardware.

- With the compiled kernels, one call of the C++ `paged_attention` per layer for every
  row of the step (fresh prompts, decodes, chunks that continue a cached prompt),
  reading keys and values in place through the block tables (`csrc/paged_attention.cpp`).
  On fresh prompts it takes 0.5-0.85x the CPU time of the query-block matmuls below
  (135M shape, 256-4096 tokens, bfloat16 with AVX512-BF16 and float32; about even in
  bfloat16 on CPUs without it), so they are no longer used beside it (BENCHMARKS §17).
- Without them (no compiler, or `cpu_kernels` off), in PyTorch: fresh prompts as query
  blocks of batched matmuls over the causal triangle (`causal_in_query_blocks`, 1.85x
  SDPA's CPU kernel on bfloat16 prompts); decodes by batched matmul over (kv head x
  request) with the query heads sharing a kv head as rows, then `F.embedding_bag` sums
  the value rows weighted by the probabilities straight from the cache; chunks by SDPA
  over gathered blocks.

Batch-invariant mode (`batch_invariant=True`, kernels required): the kernel is told to score
every row the same way (no transposed-key scoring for tiles of 4+ rows). A row then reduces
its keys in 64-key chunks at fixed positions, in position order, with its own online
softmax, whatever its neighbours, its tile or its prompt's chunking: its output depends on
its query and its keys alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from carpool.attention import paged
from carpool.attention.base import AttentionBackend, AttentionShape, StepLayout

PREFILL_QUERY_BLOCK = 128  # query rows per matmul in `causal_in_query_blocks`


@dataclass(frozen=True)
class ValueBags:
    """For `F.embedding_bag` over the cache viewed as [2 * Hkv * num_blocks * block_size, D]:
    the value row of every (kv head, request, query head, key position), and where each
    (kv head, request, query head) bag starts."""

    rows: torch.Tensor
    offsets: torch.Tensor


@dataclass(frozen=True)
class KernelRows:
    """The requests the C++ kernel attends (every one of the step), int32."""

    block_tables: torch.Tensor  # [S, max_blocks], padded with block 0 (never read)
    query_starts: torch.Tensor  # [S]
    query_lens: torch.Tensor  # [S]
    seq_lens: torch.Tensor  # [S]: tokens in the cache once this step's are written


@dataclass(frozen=True)
class CpuMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    fresh_spans: tuple[tuple[int, int], ...]
    num_tokens: int
    kernel_rows: KernelRows | None = None  # with the compiled kernels; else the groups below
    prefill_rows: KernelRows | None = None  # bfloat16 chunks for `prefill_attention_bf16`
    decode_groups: tuple[paged.PagedGroup, ...] = ()
    decode_bags: tuple[ValueBags, ...] = ()  # one per decode group
    chunk_group: paged.PagedGroup | None = None


class CpuBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, shape: AttentionShape, device: torch.device,
                 kernels: ModuleType | None = None, batch_invariant: bool = False) -> None:
        # The kernel keeps a query row in registers: it takes head_dim up to 256 (AVX-512
        # builds) or 128; above that this backend keeps its PyTorch paths.
        if kernels is not None and shape.head_dim > kernels.max_head_dim():
            if batch_invariant:
                raise ValueError(f"batch_invariant needs the C++ attention kernel, which takes "
                                 f"head_dim up to {kernels.max_head_dim()} in this build "
                                 f"(the model's is {shape.head_dim})")
            kernels = None
        super().__init__(shape, device, kernels)
        self.batch_invariant = batch_invariant
        # bfloat16 prompt chunks (every request of 2+ tokens) take `prefill_attention_bf16`
        # where the CPU has AVX512-BF16; decodes stay with `paged_attention`.
        self.bf16_prefill = (kernels is not None and not batch_invariant
                             and shape.dtype == torch.bfloat16 and shape.sliding_window is None
                             and kernels.has_bf16_gemm()
                             and kernels.prefill_head_dim_ok(shape.head_dim))
        # ... with both products on AMX tiles where the CPU has them (head_dim in 32s).
        self.prefill_amx = (self.bf16_prefill and shape.head_dim % 32 == 0
                            and kernels.has_amx())

    def build_metadata(self, layout: StepLayout) -> CpuMetadata:
        slots = torch.as_tensor(layout.slot_mapping, device=self.device, dtype=torch.int64)
        common = dict(slot_mapping=slots, num_tokens=layout.num_tokens)
        if self.bf16_prefill:  # decodes to paged_attention, chunks to the prefill kernel
            is_chunk = layout.query_lens > 1
            decodes, chunks = np.flatnonzero(~is_chunk), np.flatnonzero(is_chunk)
            return CpuMetadata(
                **common, fresh_spans=(),
                kernel_rows=_kernel_rows(layout, decodes) if len(decodes) else None,
                prefill_rows=_kernel_rows(layout, chunks) if len(chunks) else None)
        if self.kernels is not None:  # the kernel takes every row
            rows = np.arange(len(layout.query_lens))
            return CpuMetadata(**common, fresh_spans=(), kernel_rows=_kernel_rows(layout, rows))
        split = paged.split_step(layout, fresh_fast_path=self.shape.sliding_window is None)
        common["fresh_spans"] = paged.fresh_spans(layout, split.fresh)
        decode_groups = tuple(paged.build_group(layout, rows, self.shape, self.device)
                              for rows in split.decode_groups)
        chunk_group = (paged.build_group(layout, split.chunks, self.shape, self.device)
                       if len(split.chunks) else None)
        return CpuMetadata(
            **common, decode_groups=decode_groups,
            decode_bags=tuple(_value_bags(g, self.shape, layout) for g in decode_groups),
            chunk_group=chunk_group)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               meta: CpuMetadata, scale: float) -> torch.Tensor:
        if meta.kernel_rows is not None or meta.prefill_rows is not None:
            # Every row is written by a kernel.
            out = torch.empty_like(q)
        else:
            out = torch.zeros_like(q)
        if meta.prefill_rows is not None:
            rows = meta.prefill_rows
            self.kernels.prefill_attention_bf16(out, q, kv_cache, rows.block_tables,
                                                rows.query_starts, rows.query_lens,
                                                rows.seq_lens, scale, amx=self.prefill_amx)
        if meta.kernel_rows is not None:
            rows = meta.kernel_rows
            self.kernels.paged_attention(out, q, kv_cache, rows.block_tables, rows.query_starts,
                                         rows.query_lens, rows.seq_lens, scale,
                                         self.shape.sliding_window or 0,
                                         batch_invariant=self.batch_invariant)
        for group, bags in zip(meta.decode_groups, meta.decode_bags):
            out[group.valid_tokens] = attend_decodes(q, kv_cache, group, bags, scale)
        if meta.chunk_group is not None:
            group = meta.chunk_group
            out[group.valid_tokens] = paged.attend_group_sdpa(q, kv_cache, group, scale)
        for start, length in meta.fresh_spans:
            span = slice(start, start + length)
            out[span] = causal_in_query_blocks(q[span], k[span], v[span], scale)
        return out


def attend_decodes(q: torch.Tensor, kv_cache: torch.Tensor, group: paged.PagedGroup,
                   bags: ValueBags, scale: float) -> torch.Tensor:
    """One query per request: scores by batched matmul, a float32 softmax, then values.

    The fused SDPA kernel is slow on CPU for a single query: about 7x slower than this
    in bfloat16, 1.15x in float32 (135M-shaped model, 40 decodes). The batch is
    (kv head, request): each request's gathered keys for one head are a contiguous
    matrix, and the G query heads sharing it are the rows multiplying it. The values
    are never gathered: `F.embedding_bag` sums the value rows, weighted by the
    probabilities, straight from the cache (2.3x faster than gather + matmul in
    bfloat16, 7x in float32).
    """
    num_seqs = group.query_index.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[1]
    group_size = num_heads // num_kv_heads
    queries = (q.index_select(0, group.query_index.reshape(-1)) * scale).view(
        num_seqs, num_kv_heads, group_size, head_dim).transpose(0, 1).reshape(
        num_kv_heads * num_seqs, group_size, head_dim)  # (Hkv * S, G, D), scaled
    keys, _ = paged.gather(kv_cache, group, values_too=False)  # (Hkv, S, max_ctx, D)
    scores = torch.bmm(queries, keys.flatten(0, 1).transpose(1, 2))  # (Hkv * S, G, max_ctx)
    scores = scores.view(num_kv_heads, num_seqs, group_size, -1).float().masked_fill_(
        ~group.mask[:, 0], float("-inf"))  # mask (S, 1, max_ctx)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)  # (Hkv, S, G, max_ctx)
    out = F.embedding_bag(bags.rows, kv_cache.view(-1, head_dim), bags.offsets, mode="sum",
                          per_sample_weights=probs.reshape(-1))  # (Hkv * S * G, D)
    out = out.view(num_kv_heads, num_seqs, group_size, head_dim)
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


def _kernel_rows(layout: StepLayout, rows: np.ndarray) -> KernelRows:
    """The kernel's int32 view of the requests `rows` (the whole step without copies by index
    when they are all of it: the usual case)."""
    pick = slice(None) if len(rows) == len(layout.query_lens) else rows
    query_lens = layout.query_lens[pick]
    seq_lens = layout.num_computed[pick] + query_lens
    return KernelRows(
        block_tables=torch.from_numpy(paged.padded_block_tables(layout, rows, np.int32)),
        query_starts=torch.from_numpy(layout.query_starts[pick].astype(np.int32)),
        query_lens=torch.from_numpy(query_lens.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)))


def _value_bags(group: paged.PagedGroup, shape: AttentionShape, layout: StepLayout) -> ValueBags:
    num_seqs, num_blocks = group.block_tables.shape
    block_size = layout.block_size
    value_blocks = group.gather_index[shape.num_kv_heads * num_seqs * num_blocks:]
    positions = torch.arange(block_size, device=group.gather_index.device)
    rows = (value_blocks[:, None] * block_size + positions).view(
        shape.num_kv_heads, num_seqs, 1, num_blocks * block_size)
    rows = rows.expand(-1, -1, shape.group_size, -1).reshape(-1)
    offsets = torch.arange(0, rows.numel(), num_blocks * block_size, device=rows.device)
    return ValueBags(rows=rows, offsets=offsets)


def causal_in_query_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One prompt's causal attention, q [L, H, D], k/v [L, Hkv, D] -> [L, H, D].

    Queries go in blocks of PREFILL_QUERY_BLOCK; a block's scores are taken against the
    keys up to its last position only (the causal triangle, to block granularity), as
    batched matmuls over kv heads with the query heads sharing them stacked as rows,
    around a float32 softmax, queries scaled first (as SDPA does). Only the block's own
    diagonal square needs a mask.
    """
    length, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group_size = num_heads // num_kv_heads
    # (Hkv, L, G, D): a block of query rows is one contiguous (rows * G, D) matrix per kv head.
    queries = (q * scale).view(length, num_kv_heads, group_size, head_dim).transpose(0, 1)
    queries = queries.contiguous()
    keys, values = k.transpose(0, 1), v.transpose(0, 1)  # (Hkv, L, D)
    out = torch.empty_like(q).view(length, num_kv_heads, group_size, head_dim)
    above_diagonal = _above_diagonal(q.device)
    for begin in range(0, length, PREFILL_QUERY_BLOCK):
        end = min(begin + PREFILL_QUERY_BLOCK, length)
        rows = end - begin
        block = queries[:, begin:end].view(num_kv_heads, rows * group_size, head_dim)
        scores = torch.bmm(block, keys[:, :end].transpose(1, 2)).float()
        scores = scores.view(num_kv_heads, rows, group_size, end)
        scores[..., begin:].masked_fill_(above_diagonal[:rows, :, :rows], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(num_kv_heads, rows * group_size, end)
        attended = torch.bmm(probs, values[:, :end])  # (Hkv, rows * G, D)
        out[begin:end] = attended.view(num_kv_heads, rows, group_size, head_dim).transpose(0, 1)
    return out.view(length, num_heads, head_dim)


@functools.cache
def _above_diagonal(device: torch.device) -> torch.Tensor:
    """[PREFILL_QUERY_BLOCK, 1, PREFILL_QUERY_BLOCK] bool: key above the query row (masked)."""
    return torch.ones(PREFILL_QUERY_BLOCK, PREFILL_QUERY_BLOCK, dtype=torch.bool,
                      device=device).triu_(1)[:, None]
