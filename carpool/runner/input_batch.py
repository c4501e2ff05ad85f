"""Turn a `SchedulerOutput` into the packed tensors one forward pass needs.

    packed tokens:  | req A chunk (positions a0..a0+n) | req B (1 decode token) | ... | padding |
    slot of a token at position p: block_table[p // block_size] * block_size + p % block_size

Python touches each request a few times (its counts, and one pass each over its new
token ids and its block ids, flattened at C speed by `np.fromiter`); positions, slots
and the padded block table are whole-batch numpy, never a loop per token. A request's
history is reached through its block table only. The attention side of the step is a
backend-neutral `StepLayout`; the chosen attention backend turns it into its own metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from carpool.attention import StepLayout
from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class InputBatch:
    input_ids: torch.Tensor  # [T] int64 (real tokens, then padding tokens)
    positions: torch.Tensor  # [T] int64
    layout: StepLayout
    # [N] int64: packed index of the last token of each sampled request (of its last 1 + k
    # tokens for one with k draft tokens)
    logits_indices: torch.Tensor
    sampled: list[ScheduledRequest]  # the requests that sample, in logits row order
    num_drafts: int = 0  # draft tokens in the step (each one more logits row)


def build_input_batch(scheduler_output: SchedulerOutput, *, block_size: int, scratch_block: int,
                      device: torch.device) -> InputBatch:
    """Packed ids and positions, the step's layout (slots, block tables), and logits rows.

    The cache tensors hold `scratch_block + 1` blocks; padding tokens read and write
    the scratch block, as one-token requests at position 0.
    """
    scheduled = scheduler_output.scheduled
    num_padding = scheduler_output.num_padding_tokens
    num_reqs = len(scheduled)
    # One pass over the requests for their counts: [S, 4] = new tokens, computed, blocks, sample
    counts = np.array([(len(r.token_ids), r.num_computed_tokens, len(r.block_ids),
                        r.num_logits_rows) for r in scheduled], dtype=np.int64).reshape(num_reqs, 4)
    query_lens, num_computed = counts[:, 0], counts[:, 1]
    if num_reqs and not query_lens.all():
        empty = scheduled[int(np.argmin(query_lens))]
        raise ValueError(f"request {empty.request_id!r} is scheduled with no tokens")
    num_real = int(query_lens.sum())
    ids = np.zeros(num_real + num_padding, dtype=np.int64)  # padding tokens are id 0
    ids[:num_real] = np.fromiter(chain.from_iterable(r.token_ids for r in scheduled), np.int64,
                                 num_real)
    table = _block_table(scheduled, num_computed + query_lens, counts[:, 2], block_size)
    if num_padding:
        query_lens = np.concatenate([query_lens, np.ones(num_padding, dtype=np.int64)])
        num_computed = np.concatenate([num_computed, np.zeros(num_padding, dtype=np.int64)])
        pad_rows = np.zeros((num_padding, max(table.shape[1], 1)), dtype=np.int32)
        pad_rows[:, 0] = scratch_block
        table = np.concatenate([_widen(table, pad_rows.shape[1]), pad_rows])
    query_starts = np.cumsum(query_lens) - query_lens
    # positions: num_computed[i] + (token index - query_starts[i]) for every token of row i
    rows = np.repeat(np.arange(len(query_lens)), query_lens)
    positions = np.arange(len(ids)) + (num_computed - query_starts)[rows]
    slots = table[rows, positions // block_size].astype(np.int64) * block_size + (
        positions % block_size)
    num_rows = counts[:, 3]
    # each sampled request's last num_rows tokens, in order
    row_ends = np.repeat(query_starts[:num_reqs] + query_lens[:num_reqs], num_rows)
    row_offsets = np.arange(len(row_ends)) - np.repeat(np.cumsum(num_rows), num_rows)
    layout = StepLayout(query_starts=query_starts, query_lens=query_lens,
                        num_computed=num_computed, block_table=table, slot_mapping=slots,
                        num_cache_blocks=scratch_block + 1, block_size=block_size)
    to = dict(device=device, dtype=torch.int64)
    return InputBatch(input_ids=torch.as_tensor(ids, **to),
                      positions=torch.as_tensor(positions, **to), layout=layout,
                      logits_indices=torch.as_tensor(row_ends + row_offsets, **to),
                      sampled=[r for r in scheduled if r.sample],
                      num_drafts=int(num_rows.sum()) - int((num_rows > 0).sum()))


def _block_table(scheduled: list[ScheduledRequest], num_tokens: np.ndarray, num_held: np.ndarray,
                 block_size: int) -> np.ndarray:
    """[S, most blocks needed] int32: the blocks covering positions [0, num_tokens[i]) of each
    request (which holds num_held[i]), padded with block 0; ValueError naming a request whose
    table is too short."""
    num_needed = -(-num_tokens // block_size)
    short = np.flatnonzero(num_held < num_needed)
    if len(short):
        i = int(short[0])
        raise ValueError(f"request {scheduled[i].request_id!r} needs {num_needed[i]} KV blocks "
                         f"for {num_tokens[i]} tokens, its block table has {num_held[i]}")
    held = np.fromiter(chain.from_iterable(r.block_ids for r in scheduled), np.int32,
                       int(num_held.sum()))
    width = int(num_held.max()) if len(scheduled) else 0
    table = np.zeros((len(scheduled), width), dtype=np.int32)
    table[np.arange(width) < num_held[:, None]] = held
    if (num_held > num_needed).any():  # blocks beyond this step's tokens: not part of it
        table[np.arange(width) >= num_needed[:, None]] = 0
    return table[:, :int(num_needed.max()) if len(scheduled) else 0]


def _widen(table: np.ndarray, width: int) -> np.ndarray:
    """`table` padded with block 0 to `width` columns."""
    if table.shape[1] >= width:
        return table
    return np.pad(table, ((0, 0), (0, width - table.shape[1])))
