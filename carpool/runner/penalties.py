"""Logit processors that depend on a request's tokens so far: min_tokens and penalties.

- min_tokens: while fewer outputs than `min_tokens`, stop tokens (and EOS unless
  `ignore_eos`) get -inf, so the request cannot end early.
- repetition_penalty (Hugging Face semantics, over prompt + outputs): a seen
  token's logit is divided by the penalty if positive, multiplied if negative.
- presence / frequency penalties (OpenAI semantics, over outputs only):
  logit -= presence * [count > 0] + frequency * count.

Only rows that use a knob pay for it; token lists become one padded id matrix
(a C-level copy per list), never a Python loop over tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from carpool.core.scheduler_output import ScheduledRequest


def needs_processing(requests: list[ScheduledRequest], eos_token_ids: tuple[int, ...]) -> bool:
    """True when any row has a penalty or an active min_tokens mask."""
    return any(r.sampling_params.has_penalty or _min_tokens_ids(r, eos_token_ids) for r in requests)


def apply_min_tokens(logits: torch.Tensor, requests: list[ScheduledRequest],
                     eos_token_ids: tuple[int, ...]) -> None:
    """Mask stop tokens in place for rows still short of min_tokens."""
    rows, cols = [], []
    vocab_size = logits.shape[-1]
    for row, req in enumerate(requests):
        for token_id in _min_tokens_ids(req, eos_token_ids):
            if token_id < vocab_size:
                rows.append(row)
                cols.append(token_id)
    if rows:
        logits[rows, cols] = float("-inf")


def apply_penalties(logits: torch.Tensor, requests: list[ScheduledRequest]) -> None:
    """Apply repetition, presence and frequency penalties in place, all penalised rows at once."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.has_penalty]
    if not rows:
        return
    vocab_size = logits.shape[-1]
    params = [requests[i].sampling_params for i in rows]
    outputs = [requests[i].output_token_ids for i in rows]
    prompts = [requests[i].prompt_token_ids for i in rows]
    output_counts = _token_counts(outputs, vocab_size, logits)  # (R, V)
    seen = (_token_counts(prompts, vocab_size, logits) + output_counts) > 0  # (R, V)
    column = dict(device=logits.device, dtype=logits.dtype)
    repetition = torch.tensor([p.repetition_penalty for p in params], **column)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], **column)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in params], **column)[:, None]
    sub = logits[rows]
    penalised = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(seen, penalised, sub)
    sub = sub - frequency * output_counts - presence * (output_counts > 0).to(sub.dtype)
    logits[rows] = sub


def _token_counts(token_lists, vocab_size: int, like: torch.Tensor) -> torch.Tensor:
    """[R, V] counts of each token id per list (a padded id matrix, one scatter_add)."""
    longest = max((len(t) for t in token_lists), default=0)
    matrix = np.full((len(token_lists), max(longest, 1)), vocab_size, dtype=np.int64)
    for i, tokens in enumerate(token_lists):
        matrix[i, :len(tokens)] = tokens
    index = torch.as_tensor(matrix, device=like.device)
    counts = torch.zeros((len(token_lists), vocab_size + 1), device=like.device, dtype=like.dtype)
    counts.scatter_add_(1, index, torch.ones(index.shape, device=like.device, dtype=like.dtype))
    return counts[:, :vocab_size]  # drop the padding column


def _min_tokens_ids(req: ScheduledRequest, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    p = req.sampling_params
    if len(req.output_token_ids) >= p.min_tokens:
        return ()
    return tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(eos_token_ids))
