"""Paged attention over a flat packed batch, in plain PyTorch (any device).

The KV cache of one layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(keys, values). A token at position p of a request lives in slot
`block_ids[p // block_size] * block_size + p % block_size`.

Each step, the scheduled requests are split into `AttentionGroup`s: decodes
(one query each), cut into groups of similar context length, and prefill chunks
that continue a prompt (several queries each). Per group, every request's keys
and values are gathered from its block table into a padded `[num_seqs, max_ctx]`
view, the queries into `[num_seqs, max_q]`, and one `scaled_dot_product_attention`
call with a boolean mask (key position <= query position, within the sliding
window if any) computes all of them at once: no Python loop over requests
inside a group. Grouping keeps a long context from padding every short one up
to its length, which is most of the copying on a CPU. Prompts prefilled from
position 0 (`FreshPrefills`) need no history: each gets one causal SDPA call
over its own keys, without padding or a mask. On CUDA, SDPA picks its fused
kernel for these shapes; the same code is the reference on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


# Decode groups in these dtypes take `_attend_decodes` instead of SDPA (see there).
DECODE_MATMUL_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class AttentionGroup:
    """Requests attended together in one batched SDPA call (index tensors built once per step)."""

    query_index: torch.Tensor  # [S, max_q] int64: packed token index of each query (pads repeat one)
    block_tables: torch.Tensor  # [S, max_blocks] int64: block ids (pads point at any block; masked)
    mask: torch.Tensor  # [S, 1, max_q, max_blocks * block_size] bool: True = may attend
    valid_rows: torch.Tensor  # [num_valid] int64: rows of the flattened [S * max_q] that are real
    valid_tokens: torch.Tensor  # [num_valid] int64: their packed token index


@dataclass
class FreshPrefills:
    """Prompts prefilled from position 0 in this step: each attends causally to its own tokens.

    Their keys and values are exactly the ones this step writes, so they are read back by
    slot (real tokens only) and each prompt gets its own causal SDPA call: no padding to
    the longest prompt, no mask, and the kernel skips the blocks above the diagonal.
    """

    spans: list[tuple[int, int]]  # (packed start, length) per prompt, in packed order
    slots: torch.Tensor  # [sum of lengths] int64: their cache slots, spans concatenated


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
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q [T, num_heads, head_dim] -> out [T, num_heads, head_dim], reading K/V from the cache.

    The cache must already hold this step's new K/V (`write_kv` first).
    """
    out = torch.zeros_like(q)
    for group in meta.groups:  # decodes (in groups of similar context length), later chunks
        if group.query_index.shape[1] == 1 and q.dtype in DECODE_MATMUL_DTYPES:
            out[group.valid_tokens] = _attend_decodes(q, kv_cache, group, scale)
        else:
            out[group.valid_tokens] = _attend_group(q, kv_cache, group, scale)
    if meta.fresh_prefills is not None:
        _attend_fresh(q, kv_cache, meta.fresh_prefills, scale, out)
    return out


def _attend_fresh(q: torch.Tensor, kv_cache: torch.Tensor, fresh: FreshPrefills, scale: float,
                  out: torch.Tensor) -> None:
    """Causal attention of each fresh prompt over its own keys, written into `out` rows."""
    num_heads, num_kv_heads, head_dim = q.shape[1], kv_cache.shape[3], q.shape[2]
    keys = kv_cache[0].view(-1, num_kv_heads, head_dim).index_select(0, fresh.slots)
    values = kv_cache[1].view(-1, num_kv_heads, head_dim).index_select(0, fresh.slots)
    offset = 0
    for start, length in fresh.spans:
        span = slice(offset, offset + length)
        # 4-D (batch of one): 3-D inputs send CPU SDPA to its slower math backend.
        attended = F.scaled_dot_product_attention(
            q[start:start + length].transpose(0, 1)[None], keys[span].transpose(0, 1)[None],
            values[span].transpose(0, 1)[None], is_causal=True, scale=scale,
            enable_gqa=num_heads != num_kv_heads)  # (1, H, length, D)
        out[start:start + length] = attended[0].transpose(0, 1)
        offset += length


def _attend_group(q: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup,
                  scale: float) -> torch.Tensor:
    num_seqs, max_q = group.query_index.shape
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    queries = q.index_select(0, group.query_index.reshape(-1)).view(
        num_seqs, max_q, num_heads, head_dim).transpose(1, 2)  # (S, num_heads, max_q, head_dim)
    keys = _gather(kv_cache[0], group.block_tables)  # (S, num_kv_heads, max_ctx, head_dim)
    values = _gather(kv_cache[1], group.block_tables)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask,
                                         scale=scale,
                                         enable_gqa=num_heads != num_kv_heads)
    out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
    return out[group.valid_rows]  # (num_valid, num_heads, head_dim)


def _attend_decodes(q: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup,
                    scale: float) -> torch.Tensor:
    """One query per request: two batched matmuls around a float32 softmax (HF's eager order).

    On CPU the fused SDPA kernel is slow for a single reduced-precision query (about 7x
    slower than these matmuls for bfloat16), so decode groups in those dtypes come here.
    """
    num_seqs = group.query_index.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    queries = q.index_select(0, group.query_index.reshape(-1)).view(
        num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # (S, Hkv, G, D)
    keys = _gather(kv_cache[0], group.block_tables)  # (S, Hkv, max_ctx, D)
    values = _gather(kv_cache[1], group.block_tables)
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale  # (S, Hkv, G, max_ctx)
    scores = scores.float().masked_fill(~group.mask, float("-inf"))  # mask (S, 1, 1, max_ctx)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values).reshape(num_seqs, num_heads, head_dim)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, H, D], tables [S, B] -> [S, H, B * block_size, D]."""
    num_seqs, num_blocks = block_tables.shape
    _, block_size, num_heads, head_dim = cache.shape
    # index_select copies whole blocks (memcpy); advanced indexing copies element by element.
    blocks = cache.index_select(0, block_tables.reshape(-1))  # (S * B, block_size, H, D)
    return blocks.view(num_seqs, num_blocks * block_size, num_heads, head_dim).transpose(1, 2)
