"""The CPU backend without the compiled kernels (none built, `cpu_kernels` off, or a head_dim
above what they take): PyTorch paths that beat SDPA's CPU kernels here.

- Fresh prompts as query blocks of batched matmuls over the causal triangle
  (`causal_in_query_blocks`): fewer ops than SDPA's CPU kernel on bfloat16 prompts.
- Decodes by batched matmul over (kv head x request) with the query heads sharing a kv head as
  rows, then `F.embedding_bag` sums the value rows weighted by the probabilities straight from
  the cache.
- Chunks that continue a cached prompt by SDPA over gathered blocks.

The route (`carpool.attention.paths.decide_attention`) picks this backend or the kernels'
(`cpu_kernel`); measurements: docs/lab/09-attention-backends-and-the-c-cpu-kernels.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

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
class CpuTorchMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    num_tokens: int
    fresh_spans: tuple[tuple[int, int], ...]  # (packed start, length) of each fresh prompt
    decode_groups: tuple[paged.PagedGroup, ...]
    decode_bags: tuple[ValueBags, ...]  # one per decode group
    chunk_group: paged.PagedGroup | None  # the chunks that continue a cached prompt, if any


class CpuTorchBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, shape: AttentionShape, device: torch.device,
                 kernels: ModuleType | None = None) -> None:
        super().__init__(shape, device, None)  # the KV write too stays in PyTorch

    def build_metadata(self, layout: StepLayout) -> CpuTorchMetadata:
        slots = torch.as_tensor(layout.slot_mapping, device=self.device, dtype=torch.int64)
        split = paged.split_step(layout, fresh_fast_path=self.shape.sliding_window is None)
        decode_groups = tuple(paged.build_group(layout, rows, self.shape, self.device)
                              for rows in split.decode_groups)
        chunk_group = (paged.build_group(layout, split.chunks, self.shape, self.device)
                       if len(split.chunks) else None)
        return CpuTorchMetadata(
            slot_mapping=slots, num_tokens=layout.num_tokens,
            fresh_spans=paged.fresh_spans(layout, split.fresh), decode_groups=decode_groups,
            decode_bags=tuple(_value_bags(g, self.shape, layout) for g in decode_groups),
            chunk_group=chunk_group)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               meta: CpuTorchMetadata, scale: float) -> torch.Tensor:
        out = torch.zeros_like(q)
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

    The fused SDPA kernel is slow on CPU for a single query
    (docs/lab/09-attention-backends-and-the-c-cpu-kernels.md). The batch is (kv head,
    request): each request's gathered keys for one head are a contiguous matrix, and the G
    query heads sharing it are the rows multiplying it. The values are never gathered:
    `F.embedding_bag` sums the value rows, weighted by the probabilities, straight from the
    cache (one pass instead of a copy and a matmul).
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
