"""Paged attention in plain PyTorch, shared by the backends: grouping, masks, gathers, SDPA.

Each step, the scheduled requests are split three ways (`split_step`):
- prompts prefilled from position 0 (*fresh*): their keys and values are exactly
  the ones this step computes, so each attends causally to this step's k/v,
  nothing read from the cache and no padding (not with a sliding window, whose
  mask the causal fast paths do not apply);
- decodes (one query each), sorted by context length and cut into groups, so a
  long context does not pad every short one up to its length (on CPU; a backend on a
  GPU, where each group's launches cost more than the padding, asks for one group);
- chunks that continue a prompt (several queries, history in the cache), one group.

Per group, every request's keys and values are gathered from its block table into
a padded `[num_seqs, max_ctx]` view, the queries into `[num_seqs, max_q]`, and one
batched call with a boolean mask (key position <= query position, within the
sliding window if any) attends all of them: no Python loop over requests.
All index tensors are built once per step, here, before the first layer runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from carpool.attention.base import AttentionShape, StepLayout

MAX_DECODE_GROUPS = 8
MIN_ROWS_PER_DECODE_GROUP = 16


@dataclass(frozen=True)
class PagedGroup:
    """Requests attended together in one batched call (index tensors on the device)."""

    # [S, max_q] int64: packed token index of each query (pads repeat one)
    query_index: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int64: block ids (pads point at block 0; masked)
    mask: torch.Tensor  # [S, 1, max_q, max_blocks * block_size] bool: True = may attend
    valid_rows: torch.Tensor  # [num_valid] int64: rows of the flattened [S * max_q] that are real
    valid_tokens: torch.Tensor  # [num_valid] int64: their packed token index
    # Rows of the cache viewed as [2 * Hkv * num_cache_blocks, block_size, D] holding the
    # group's blocks: keys of kv head 0, 1, ..., then values, each in block-table order.
    gather_index: torch.Tensor


@dataclass(frozen=True)
class StepSplit:
    """Request indices of a `StepLayout`, split by how they are attended."""

    fresh: np.ndarray  # prompts from position 0, attended over this step's k/v
    decode_groups: tuple[np.ndarray, ...]  # one-query requests, grouped by context length
    chunks: np.ndarray  # several queries after cached history


def fresh_mask(layout: StepLayout, fresh_fast_path: bool) -> np.ndarray:
    """[S] bool: prompts prefilled from position 0 this step (none without the fast path)."""
    return (layout.num_computed == 0) & (layout.query_lens > 1) & fresh_fast_path


def split_step(layout: StepLayout, fresh_fast_path: bool,
               max_decode_groups: int = MAX_DECODE_GROUPS) -> StepSplit:
    """Fresh prompts (if `fresh_fast_path`), up to `max_decode_groups` decode groups, and the
    remaining chunks."""
    if max_decode_groups < 1:
        raise ValueError(f"max_decode_groups must be >= 1, got {max_decode_groups}")
    is_fresh = fresh_mask(layout, fresh_fast_path)
    is_decode = layout.query_lens == 1
    decodes = np.flatnonzero(is_decode)
    groups = _length_buckets(decodes, layout, max_decode_groups) if len(decodes) else ()
    return StepSplit(fresh=np.flatnonzero(is_fresh), decode_groups=groups,
                     chunks=np.flatnonzero(~is_fresh & ~is_decode))


def _length_buckets(decodes: np.ndarray, layout: StepLayout,
                    max_groups: int) -> tuple[np.ndarray, ...]:
    """Decodes sorted by context length, cut into up to `max_groups` equal-count groups.

    Each group costs a few more small ops per layer, hence at least
    MIN_ROWS_PER_DECODE_GROUP rows per group.
    """
    num_groups = max(1, min(max_groups, len(decodes) // MIN_ROWS_PER_DECODE_GROUP))
    if num_groups == 1:
        return (decodes,)
    lengths = layout.num_computed[decodes]
    order = decodes[np.argsort(lengths, kind="stable")]
    return tuple(np.array_split(order, num_groups))


def build_group(layout: StepLayout, rows: np.ndarray, shape: AttentionShape,
                device: torch.device) -> PagedGroup:
    """Index tensors and mask for the requests `rows` of `layout`."""
    padded = padded_block_tables(layout, rows, np.int64)  # pads -> block 0, masked
    max_blocks = padded.shape[1]
    to = dict(device=device, dtype=torch.int64)
    q_starts = torch.as_tensor(layout.query_starts[rows], **to)
    q_lens = torch.as_tensor(layout.query_lens[rows], **to)
    num_computed = torch.as_tensor(layout.num_computed[rows], **to)
    block_tables = torch.as_tensor(padded, **to)

    max_q = int(layout.query_lens[rows].max())
    offsets = torch.arange(max_q, device=device)  # (max_q,)
    is_real = offsets[None, :] < q_lens[:, None]  # (S, max_q)
    query_index = q_starts[:, None] + torch.where(is_real, offsets[None, :], 0)
    # Padded query rows sit at position 0 and so attend key 0 only: never an empty row (no NaN).
    q_pos = torch.where(is_real, num_computed[:, None] + offsets[None, :], 0)  # (S, max_q)
    k_pos = torch.arange(max_blocks * layout.block_size, device=device)  # (max_ctx,)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # (S, max_q, max_ctx), causal
    if shape.sliding_window is not None:
        mask &= (q_pos[:, :, None] - k_pos[None, None, :]) < shape.sliding_window
    valid_rows = torch.nonzero(is_real.reshape(-1), as_tuple=True)[0]
    heads = torch.arange(2 * shape.num_kv_heads, device=device)[:, None] * layout.num_cache_blocks
    return PagedGroup(query_index=query_index, block_tables=block_tables, mask=mask[:, None],
                      valid_rows=valid_rows, valid_tokens=query_index.reshape(-1)[valid_rows],
                      gather_index=(heads + block_tables.reshape(1, -1)).reshape(-1))


def padded_block_tables(layout: StepLayout, rows: np.ndarray, dtype) -> np.ndarray:
    """[len(rows), longest table among them] block ids of the requests `rows`, padded with
    block 0 (contiguous)."""
    width = int(layout.num_blocks(rows).max())
    if len(rows) == len(layout.query_lens) and width == layout.block_table.shape[1]:
        return np.ascontiguousarray(layout.block_table, dtype=dtype)  # the whole step
    return np.ascontiguousarray(layout.block_table[rows, :width], dtype=dtype)


def gather(kv_cache: torch.Tensor, group: PagedGroup,
           values_too: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kv_cache [2, Hkv, num_blocks, block_size, D] -> the group's keys and values (None
    unless `values_too`), each [Hkv, S, B * block_size, D].

    index_select along dim 0 copies whole blocks (memcpy); along another dim, or by
    advanced indexing, it copies element by element, several times slower. So the cache is viewed
    as [2 * Hkv * num_blocks, block_size, D] and read in one call.
    """
    num_seqs, num_blocks = group.block_tables.shape
    _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    index = group.gather_index
    if not values_too:
        index = index[:num_kv_heads * num_seqs * num_blocks]
    blocks = kv_cache.view(-1, block_size, head_dim).index_select(0, index)
    both = blocks.view(-1, num_kv_heads, num_seqs, num_blocks * block_size, head_dim)
    return both[0], (both[1] if values_too else None)


def attend_group_sdpa(q: torch.Tensor, kv_cache: torch.Tensor, group: PagedGroup,
                      scale: float) -> torch.Tensor:
    """The group's real query rows [num_valid, H, D], by SDPA over its gathered blocks."""
    num_seqs, max_q = group.query_index.shape
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[1]
    queries = q.index_select(0, group.query_index.reshape(-1)).view(
        num_seqs, max_q, num_heads, head_dim).transpose(1, 2)  # (S, num_heads, max_q, head_dim)
    keys, values = gather(kv_cache, group)
    keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # (S, Hkv, max_ctx, D)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask,
                                         scale=scale, enable_gqa=num_heads != num_kv_heads)
    out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
    return out[group.valid_rows]  # (num_valid, num_heads, head_dim)


def attend_fresh_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One fresh prompt's causal attention, q [L, H, D], k/v [L, Hkv, D] -> [L, H, D]."""
    # 4-D (batch of one): 3-D inputs send CPU SDPA to its slower math backend.
    attended = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])  # (1, H, L, D)
    return attended[0].transpose(0, 1)


def fresh_spans(layout: StepLayout, rows: np.ndarray) -> tuple[tuple[int, int], ...]:
    """(packed start, length) of each fresh prompt, in packed order."""
    return tuple((int(layout.query_starts[i]), int(layout.query_lens[i])) for i in rows)
