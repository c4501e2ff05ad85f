"""Which tokens a sampled row may still draw: min_p, then top_k and top_p (the sampler's
last steps before the draw, after penalties and temperature).

Its own module because it is one job with its own tricks (the cut looks at each row's best
logits first and sorts the whole vocabulary only for the rows that need it); `Sampler`
calls it and holds the generators, the draws and the logprobs.
"""

from __future__ import annotations

import torch


def apply_min_p(logits: torch.Tensor, params) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    min_p = torch.tensor([p.min_p for p in params], device=logits.device, dtype=logits.dtype)
    if not bool((min_p > 0).any()):
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


# Candidates per row the top-k / top-p cut looks at first (torch.topk), before a full sort.
TOP_CANDIDATES = 1024


def apply_top_k_top_p(logits: torch.Tensor, params) -> torch.Tensor:
    """Keep each row's top_k tokens (0: all), then the smallest prefix whose mass reaches top_p.

    Sorting the whole vocabulary costs more than a small model's decode step
    (docs/lab/26-prefix-blocks-shared-within-the-step-that.md), so the cut is made among each
    row's best logits: the largest top_k of the batch, or TOP_CANDIDATES if a row has top_p
    alone. They hold every kept token when the row's top_k is within them or its top_p
    prefix ends inside them; only the other rows are sorted whole."""
    vocab_size = logits.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params],
                         device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
    no_k = top_k == vocab_size
    untouched = no_k & (top_p >= 1.0)
    if bool(untouched.all()):
        return logits
    top_p_only = no_k & ~untouched
    width = int(top_k[~no_k].max()) if bool((~no_k).any()) else 0
    if bool(top_p_only.any()):
        width = max(width, TOP_CANDIDATES)
    if width >= vocab_size:
        return _cut_sorted(logits, *logits.sort(dim=-1, descending=True), top_k, top_p)
    values, order = logits.topk(width, dim=-1)  # (N, width), best first
    full_norm, inside = None, ~untouched
    if bool(top_p_only.any()):
        # A row without top_k keeps its top_p prefix: it ends inside the candidates if they
        # hold at least top_p of the row's probability.
        full_norm = logits.logsumexp(dim=-1)
        inside = ~no_k | (top_p_only & (torch.exp(values.logsumexp(dim=-1) - full_norm) >= top_p))
    if bool(inside.all()):
        return _cut_sorted(logits, values, order, top_k, top_p, full_norm)
    out = logits.clone()  # untouched rows stay as they are
    rows = inside.nonzero().flatten()
    if rows.numel():
        out[rows] = _cut_sorted(logits[rows], values[rows], order[rows], top_k[rows],
                                top_p[rows], None if full_norm is None else full_norm[rows])
    rows = (~inside & ~untouched).nonzero().flatten()
    if rows.numel():
        out[rows] = _cut_sorted(logits[rows], *logits[rows].sort(dim=-1, descending=True),
                                top_k[rows], top_p[rows])
    return out


def _cut_sorted(logits: torch.Tensor, sorted_logits: torch.Tensor, order: torch.Tensor,
                top_k: torch.Tensor, top_p: torch.Tensor,
                full_norm: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, V] -> [N, V] with -inf outside each row's top_k and top_p prefix, given
    its best logits sorted (all of them, or the candidates: then full_norm, each row's
    logsumexp, scales the rows without top_k; rows with one renormalise over their top_k)."""
    ranks = torch.arange(sorted_logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    if full_norm is not None:
        whole_row = top_k >= logits.shape[-1]
        sorted_probs = torch.where(whole_row[:, None],
                                   torch.exp(sorted_logits - full_norm[:, None]), sorted_probs)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly better tokens
    # Rows with top_p == 1 keep everything, even where float rounding makes the mass reach 1 early.
    drop = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
