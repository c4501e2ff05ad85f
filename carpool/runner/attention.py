"""Paged attention over a flat packed batch, in plain PyTorch (any device).

The KV cache of one layer is `[2, num_kv_heads, num_blocks, block_size, head_dim]`
(keys, values; head-major). A token at position p of a request lives in slot
`block_ids[p // block_size] * block_size + p % block_size` of every head. Gathering
a request's blocks therefore gives, per head, its keys as one contiguous
`[context, head_dim]` matrix, which batched matmuls and SDPA take without a copy.

Each step, the scheduled requests are split into `AttentionGroup`s: decodes
(one query each), cut into groups of similar context length, and prefill chunks
that continue a prompt (several queries each). Per group, every request's keys
and values are gathered from its block table into a padded `[num_seqs, max_ctx]`
view, the queries into `[num_seqs, max_q]`, and one `scaled_dot_product_attention`
call with a boolean mask (key position <= query position, within the sliding
window if any) computes all of them at once: no Python loop over requests
inside a group. Grouping keeps a long context from padding every short one up
to its length, which is most of the copying on a CPU. Prompts prefilled from
position 0 (`FreshPrefills`) need no history: each attends causally to the keys
this step computed for it, without padding (one SDPA call on CUDA, query blocks
of batched matmuls on CPU). On CPU, decodes go through batched matmuls and
`F.embedding_bag` instead of SDPA (see `_attend_decodes`); on CUDA, SDPA picks
its fused kernels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


# Decode groups on CPU, and in these dtypes anywhere, take `_attend_decodes` instead of SDPA.
DECODE_MATMUL_DTYPES = (torch.bfloat16, torch.float16)
PREFILL_QUERY_BLOCK = 128  # query rows per matmul in `_causal_in_query_blocks` (CPU prompts)


@dataclass
class AttentionGroup:
    """Requests attended together in one batched SDPA call (index tensors built once per step)."""

    query_index: torch.Tensor  # [S, max_q] int64: packed token index of each query (pads repeat one)
    block_tables: torch.Tensor  # [S, max_blocks] int64: block ids (pads point at any block; masked)
    mask: torch.Tensor  # [S, 1, max_q, max_blocks * block_size] bool: True = may attend
    valid_rows: torch.Tensor  # [num_valid] int64: rows of the flattened [S * max_q] that are real
    valid_tokens: torch.Tensor  # [num_valid] int64: their packed token index
    # Derived from block_tables on first use (the first layer needs the cache's shape):
    # block rows to gather (`_block_index`), value rows and bag starts (`_value_bags`).
    head_block_index: torch.Tensor | None = None
    value_rows: torch.Tensor | None = None
    bag_offsets: torch.Tensor | None = None


@dataclass
class FreshPrefills:
    """Prompts prefilled from position 0 in this step: each attends causally to its own tokens.

    Their keys and values are exactly the ones this step computes, so they are taken from
    this step's k and v (nothing is read from the cache) and each prompt is attended on
    its own: no padding to the longest prompt, and no work above the diagonal beyond
    one query block.
    """

    spans: list[tuple[int, int]]  # (packed start, length) per prompt, in packed order


@dataclass
class AttentionMetadata:
    """Everything a layer needs besides q/k/v: where to write, what to read."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot for each packed token's new K/V
    groups: list[AttentionGroup]
    num_tokens: int  # T, packed tokens including any padding tokens
    fresh_prefills: FreshPrefills | None = None


def build_group(q_starts: torch.Tensor, q_lens: torch.Tensor, num_computed: torch.Tensor,
                block_tables: torch.Tensor, block_size: int,
                sliding_window: int | None) -> AttentionGroup:
    """Index tensors and mask for S requests (all arguments on the target device).

    q_starts/q_lens/num_computed are [S]; request i's queries are packed tokens
    [q_starts[i], q_starts[i] + q_lens[i]) at positions num_computed[i] + j.
    """
    max_q = int(q_lens.max())
    offsets = torch.arange(max_q, device=q_lens.device)  # (max_q,)
    is_real = offsets[None, :] < q_lens[:, None]  # (S, max_q)
    query_index = q_starts[:, None] + torch.where(is_real, offsets[None, :], 0)
    # Padded query rows sit at position 0 and so attend key 0 only: never an empty row (no NaN).
    q_pos = torch.where(is_real, num_computed[:, None] + offsets[None, :], 0)  # (S, max_q)
    max_ctx = block_tables.shape[1] * block_size
    k_pos = torch.arange(max_ctx, device=q_lens.device)  # (max_ctx,)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # (S, max_q, max_ctx), causal
    if sliding_window is not None:
        mask &= (q_pos[:, :, None] - k_pos[None, None, :]) < sliding_window
    valid_rows = torch.nonzero(is_real.reshape(-1), as_tuple=True)[0]
    return AttentionGroup(query_index=query_index, block_tables=block_tables,
                          mask=mask[:, None], valid_rows=valid_rows,
                          valid_tokens=query_index.reshape(-1)[valid_rows])


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store new k, v [T, num_kv_heads, head_dim] at their slots of `kv_cache` (in place)."""
    _slots(kv_cache[0]).index_copy_(1, slot_mapping, k.transpose(0, 1))
    _slots(kv_cache[1]).index_copy_(1, slot_mapping, v.transpose(0, 1))


def _slots(cache: torch.Tensor) -> torch.Tensor:
    """cache [Hkv, num_blocks, block_size, D] -> [Hkv, num_blocks * block_size, D] (a view)."""
    return cache.view(cache.shape[0], -1, cache.shape[-1])


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, num_heads, head_dim] -> out [T, num_heads, head_dim], reading K/V from the cache.

    k, v [T, num_kv_heads, head_dim] are this step's new keys and values, which the
    cache must already hold (`write_kv` first); fresh prompts read them directly.
    """
    out = torch.zeros_like(q)
    for group in meta.groups:  # decodes (in groups of similar context length), later chunks
        is_decode = group.query_index.shape[1] == 1
        if is_decode and (q.device.type == "cpu" or q.dtype in DECODE_MATMUL_DTYPES):
            out[group.valid_tokens] = _attend_decodes(q, kv_cache, group, scale)
        else:
            out[group.valid_tokens] = _attend_group(q, kv_cache, group, scale)
    if meta.fresh_prefills is not None:
        _attend_fresh(q, k, v, meta.fresh_prefills, scale, out)
    return out


def _attend_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fresh: FreshPrefills,
                  scale: float, out: torch.Tensor) -> None:
    """Causal attention of each fresh prompt over its own keys, written into `out` rows."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    for start, length in fresh.spans:
        span = slice(start, start + length)
        if q.device.type == "cpu":
            out[span] = _causal_in_query_blocks(q[span], k[span], v[span], scale)
            continue
        # 4-D (batch of one): 3-D inputs send CPU SDPA to its slower math backend.
        attended = F.scaled_dot_product_attention(
            q[span].transpose(0, 1)[None], k[span].transpose(0, 1)[None],
            v[span].transpose(0, 1)[None], is_causal=True, scale=scale,
            enable_gqa=num_heads != num_kv_heads)  # (1, H, length, D)
        out[span] = attended[0].transpose(0, 1)


def _causal_in_query_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """One prompt's causal attention, q [L, H, D], k/v [L, Hkv, D] -> [L, H, D], on CPU.

    Queries go in blocks of PREFILL_QUERY_BLOCK; a block's scores are taken against the
    keys up to its last position only (the causal triangle, to block granularity), as
    batched matmuls over kv heads with the query heads sharing them stacked as rows,
    around a float32 softmax, queries scaled first (as SDPA does). Only the block's own
    diagonal square needs a mask. CPU SDPA's fused kernel ran 1.85x slower on bfloat16
    prompts of 16-512 tokens (as fast in float32).
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


def _attend_group(q: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup,
                  scale: float) -> torch.Tensor:
    num_seqs, max_q = group.query_index.shape
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[1]
    queries = q.index_select(0, group.query_index.reshape(-1)).view(
        num_seqs, max_q, num_heads, head_dim).transpose(1, 2)  # (S, num_heads, max_q, head_dim)
    keys, values = _gather(kv_cache, group)
    keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # (S, Hkv, max_ctx, D)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask,
                                         scale=scale,
                                         enable_gqa=num_heads != num_kv_heads)
    out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
    return out[group.valid_rows]  # (num_valid, num_heads, head_dim)


def _attend_decodes(q: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup,
                    scale: float) -> torch.Tensor:
    """One query per request: scores by batched matmul, a float32 softmax, then values.

    On CPU the fused SDPA kernel is slow for a single query: about 7x slower than this
    in bfloat16, 1.15x in float32 (135M-shaped model, 40 decodes), so every CPU decode
    group comes here, and reduced-precision ones on other devices.
    The batch is (kv head, request): each request's gathered keys for one head are a
    contiguous matrix, and the G = num_heads / num_kv_heads query heads sharing it are
    the rows multiplying it. On CPU the values are never gathered: `F.embedding_bag`
    sums the value rows, weighted by the probabilities, straight from the cache (2.3x
    faster than gather + matmul in bfloat16, 7x in float32).
    """
    num_seqs = group.query_index.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[1]
    group_size = num_heads // num_kv_heads
    queries = (q.index_select(0, group.query_index.reshape(-1)) * scale).view(
        num_seqs, num_kv_heads, group_size, head_dim).transpose(0, 1).reshape(
        num_kv_heads * num_seqs, group_size, head_dim)  # (Hkv * S, G, D), scaled
    on_cpu = q.device.type == "cpu"
    keys, values = _gather(kv_cache, group, values_too=not on_cpu)
    scores = torch.bmm(queries, keys.flatten(0, 1).transpose(1, 2))  # (Hkv * S, G, max_ctx)
    scores = scores.view(num_kv_heads, num_seqs, group_size, -1).float().masked_fill_(
        ~group.mask[:, 0], float("-inf"))  # mask (S, 1, max_ctx)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)  # (Hkv, S, G, max_ctx)
    if on_cpu:
        rows, offsets = _value_bags(kv_cache, group, group_size)
        out = F.embedding_bag(rows, kv_cache.view(-1, head_dim), offsets, mode="sum",
                              per_sample_weights=probs.reshape(-1))  # (Hkv * S * G, D)
    else:
        out = torch.bmm(probs.flatten(0, 1), values.flatten(0, 1))  # (Hkv * S, G, D)
    out = out.view(num_kv_heads, num_seqs, group_size, head_dim)
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


def _value_bags(kv_cache: torch.Tensor, group: AttentionGroup,
                group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For `F.embedding_bag` over the cache viewed as [2 * Hkv * num_blocks * block_size, D]:
    the value row of every (kv head, request, query head, key position), and where each
    (kv head, request, query head) bag starts. Built once per step, on first use."""
    if group.value_rows is None:
        _, num_kv_heads, _, block_size, _ = kv_cache.shape
        num_seqs, num_blocks = group.block_tables.shape
        value_blocks = _block_index(kv_cache, group)[num_kv_heads * num_seqs * num_blocks:]
        positions = torch.arange(block_size, device=kv_cache.device)
        rows = (value_blocks[:, None] * block_size + positions).view(
            num_kv_heads, num_seqs, 1, num_blocks * block_size)
        group.value_rows = rows.expand(-1, -1, group_size, -1).reshape(-1)
        group.bag_offsets = torch.arange(0, group.value_rows.numel(), num_blocks * block_size,
                                         device=kv_cache.device)
    return group.value_rows, group.bag_offsets


def _gather(kv_cache: torch.Tensor, group: AttentionGroup,
            values_too: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kv_cache [2, Hkv, num_blocks, block_size, D] -> the group's keys and values (None
    unless `values_too`), each [Hkv, S, B * block_size, D].

    index_select along dim 0 copies whole blocks (memcpy); along another dim, or by
    advanced indexing, it copies element by element, 2-3x slower. So the cache is viewed
    as [2 * Hkv * num_blocks, block_size, D] and read in one call.
    """
    num_seqs, num_blocks = group.block_tables.shape
    _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    index = _block_index(kv_cache, group)
    if not values_too:
        index = index[:num_kv_heads * num_seqs * num_blocks]
    blocks = kv_cache.view(-1, block_size, head_dim).index_select(0, index)
    both = blocks.view(-1, num_kv_heads, num_seqs, num_blocks * block_size, head_dim)
    return both[0], (both[1] if values_too else None)


def _block_index(kv_cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """The group's blocks as rows of the cache viewed as [2 * Hkv * num_blocks, ...]: keys
    of kv head 0, 1, ..., then values, each in block-table order. Built on first use."""
    if group.head_block_index is None:
        num_kv_heads, cache_blocks = kv_cache.shape[1], kv_cache.shape[2]
        heads = torch.arange(2 * num_kv_heads, device=kv_cache.device)[:, None] * cache_blocks
        group.head_block_index = (heads + group.block_tables.reshape(1, -1)).reshape(-1)
    return group.head_block_index
