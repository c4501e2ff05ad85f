"""Turn a `SchedulerOutput` into the packed tensors one forward pass needs.

    packed tokens:  | req A chunk (positions a0..a0+n) | req B (1 decode token) | ... | padding |
    slot of a token at position p: block_ids[p // block_size] * block_size + p % block_size

Work here is per request and per *new* token (numpy), never per token of the
whole context: a request's history is reached through its block table only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput
from carpool.runner.attention import AttentionGroup, AttentionMetadata, FreshPrefills, build_group


MAX_DECODE_GROUPS = 8
MIN_ROWS_PER_DECODE_GROUP = 16


@dataclass
class InputBatch:
    input_ids: torch.Tensor  # [T] int64 (real tokens, then padding tokens)
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64: packed index of the last token of each sampled request
    sampled: list[ScheduledRequest]  # the N requests that sample, in logits row order


@dataclass
class _Rows:
    """Per-request numbers of one attention group, filled while walking the batch."""

    q_starts: list[int]
    q_lens: list[int]
    num_computed: list[int]
    tables: list[np.ndarray]


def build_input_batch(scheduler_output: SchedulerOutput, *, block_size: int, scratch_block: int,
                      device: torch.device, sliding_window: int | None = None) -> InputBatch:
    """Packed ids, positions, slots, attention groups (decodes, prefill chunks), logits rows."""
    ids, positions, slots = [], [], []
    decodes, prefills = _Rows([], [], [], []), _Rows([], [], [], [])
    logits_indices, sampled = [], []
    fresh_spans = []
    start = 0
    for req in scheduler_output.scheduled:
        num_new = len(req.token_ids)
        if num_new == 0:
            raise ValueError(f"request {req.request_id!r} is scheduled with no tokens")
        table = _block_table(req, block_size)
        pos = np.arange(req.num_computed_tokens, req.num_computed_tokens + num_new)
        ids.append(np.asarray(req.token_ids, dtype=np.int64))
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        if num_new > 1 and req.num_computed_tokens == 0 and sliding_window is None:
            fresh_spans.append((start, num_new))
        else:
            rows = decodes if num_new == 1 else prefills
            _add_row(rows, start, num_new, req.num_computed_tokens, table)
        if req.sample:
            logits_indices.append(start + num_new - 1)
            sampled.append(req)
        start += num_new
    num_padding = scheduler_output.num_padding_tokens
    if num_padding:
        # Dummy sequences of one token at position 0, reading and writing the scratch block.
        ids.append(np.zeros(num_padding, dtype=np.int64))
        positions.append(np.zeros(num_padding, dtype=np.int64))
        slots.append(np.full(num_padding, scratch_block * block_size, dtype=np.int64))
        decodes.q_starts.extend(range(start, start + num_padding))
        decodes.q_lens.extend([1] * num_padding)
        decodes.num_computed.extend([0] * num_padding)
        decodes.tables.extend([np.array([scratch_block], dtype=np.int64)] * num_padding)
    to = dict(device=device, dtype=torch.int64)
    buckets = _length_buckets(decodes) if decodes.q_starts else []
    groups = [_group(rows, block_size, sliding_window, device)
              for rows in buckets + [prefills] if rows.q_starts]
    num_tokens = start + num_padding
    fresh = FreshPrefills(fresh_spans) if fresh_spans else None
    meta = AttentionMetadata(slot_mapping=torch.as_tensor(np.concatenate(slots), **to),
                             groups=groups, num_tokens=num_tokens, fresh_prefills=fresh)
    return InputBatch(input_ids=torch.as_tensor(np.concatenate(ids), **to),
                      positions=torch.as_tensor(np.concatenate(positions), **to),
                      meta=meta, logits_indices=torch.as_tensor(logits_indices, **to),
                      sampled=sampled)


def _block_table(req: ScheduledRequest, block_size: int) -> np.ndarray:
    """The blocks covering positions [0, num_computed + num_new); ValueError if too few."""
    num_needed = -(-(req.num_computed_tokens + len(req.token_ids)) // block_size)
    if len(req.block_ids) < num_needed:
        raise ValueError(f"request {req.request_id!r} needs {num_needed} KV blocks for "
                         f"{req.num_computed_tokens + len(req.token_ids)} tokens, "
                         f"its block table has {len(req.block_ids)}")
    return np.asarray(req.block_ids[:num_needed], dtype=np.int64)


def _add_row(rows: _Rows, q_start: int, q_len: int, num_computed: int, table: np.ndarray) -> None:
    rows.q_starts.append(q_start)
    rows.q_lens.append(q_len)
    rows.num_computed.append(num_computed)
    rows.tables.append(table)


def _length_buckets(rows: _Rows) -> list[_Rows]:
    """Decodes sorted by context length and cut into up to MAX_DECODE_GROUPS equal-count groups.

    A group's keys and values are gathered padded to its longest context, so one group
    of short and long contexts copies and attends mostly padding; groups of similar
    lengths waste little. Each group costs a few more small ops per layer, hence
    at least MIN_ROWS_PER_DECODE_GROUP rows per group.
    """
    num_rows = len(rows.q_starts)
    num_groups = max(1, min(MAX_DECODE_GROUPS, num_rows // MIN_ROWS_PER_DECODE_GROUP))
    if num_groups == 1:
        return [rows]
    order = sorted(range(num_rows), key=lambda i: len(rows.tables[i]))
    buckets = []
    for part in np.array_split(np.asarray(order), num_groups):
        buckets.append(_Rows([rows.q_starts[i] for i in part], [rows.q_lens[i] for i in part],
                             [rows.num_computed[i] for i in part], [rows.tables[i] for i in part]))
    return buckets


def _group(rows: _Rows, block_size: int, sliding_window: int | None,
           device: torch.device) -> AttentionGroup:
    max_blocks = max(len(t) for t in rows.tables)
    tables = np.zeros((len(rows.tables), max_blocks), dtype=np.int64)  # pads -> block 0, masked
    for i, table in enumerate(rows.tables):
        tables[i, :len(table)] = table
    to = dict(device=device, dtype=torch.int64)
    return build_group(torch.as_tensor(rows.q_starts, **to), torch.as_tensor(rows.q_lens, **to),
                       torch.as_tensor(rows.num_computed, **to), torch.as_tensor(tables, **to),
                       block_size, sliding_window)
