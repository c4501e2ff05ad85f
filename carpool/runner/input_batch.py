"""Turn a `SchedulerOutput` into the packed tensors one forward pass needs.

    packed tokens:  | req A chunk (positions a0..a0+n) | req B (1 decode token) | ... | padding |
    slot of a token at position p: block_ids[p // block_size] * block_size + p % block_size

Work here is per request and per *new* token (numpy), never per token of the
whole context: a request's history is reached through its block table only.
The attention side of the step is a backend-neutral `StepLayout`; the chosen
attention backend turns it into its own metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from carpool.attention import StepLayout
from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class InputBatch:
    input_ids: torch.Tensor  # [T] int64 (real tokens, then padding tokens)
    positions: torch.Tensor  # [T] int64
    layout: StepLayout
    # [N] int64: packed index of the last token of each sampled request
    logits_indices: torch.Tensor
    sampled: list[ScheduledRequest]  # the N requests that sample, in logits row order


def build_input_batch(scheduler_output: SchedulerOutput, *, block_size: int, scratch_block: int,
                      device: torch.device) -> InputBatch:
    """Packed ids and positions, the step's layout (slots, block tables), and logits rows.

    The cache tensors hold `scratch_block + 1` blocks; padding tokens read and write
    the scratch block.
    """
    ids, positions, slots, tables = [], [], [], []
    q_starts, q_lens, num_computed = [], [], []
    logits_indices, sampled = [], []
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
        tables.append(table)
        q_starts.append(start)
        q_lens.append(num_new)
        num_computed.append(req.num_computed_tokens)
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
        tables.extend([np.array([scratch_block], dtype=np.int64)] * num_padding)
        q_starts.extend(range(start, start + num_padding))
        q_lens.extend([1] * num_padding)
        num_computed.extend([0] * num_padding)
    layout = StepLayout(query_starts=np.asarray(q_starts, dtype=np.int64),
                        query_lens=np.asarray(q_lens, dtype=np.int64),
                        num_computed=np.asarray(num_computed, dtype=np.int64),
                        block_tables=tuple(tables), slot_mapping=np.concatenate(slots),
                        num_cache_blocks=scratch_block + 1, block_size=block_size)
    to = dict(device=device, dtype=torch.int64)
    return InputBatch(input_ids=torch.as_tensor(np.concatenate(ids), **to),
                      positions=torch.as_tensor(np.concatenate(positions), **to),
                      layout=layout, logits_indices=torch.as_tensor(logits_indices, **to),
                      sampled=sampled)


def _block_table(req: ScheduledRequest, block_size: int) -> np.ndarray:
    """The blocks covering positions [0, num_computed + num_new); ValueError if too few."""
    num_needed = -(-(req.num_computed_tokens + len(req.token_ids)) // block_size)
    if len(req.block_ids) < num_needed:
        raise ValueError(f"request {req.request_id!r} needs {num_needed} KV blocks for "
                         f"{req.num_computed_tokens + len(req.token_ids)} tokens, "
                         f"its block table has {len(req.block_ids)}")
    return np.asarray(req.block_ids[:num_needed], dtype=np.int64)
