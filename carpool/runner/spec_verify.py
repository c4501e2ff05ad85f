"""Verify a step's draft tokens: keep those the target model would have produced itself.

A request scheduled with k drafts d1..dk feeds [t, d1, .., dk] and gets k + 1 logits rows;
row j predicts the token after d1..dj. Each row is sampled exactly as a plain decode with
outputs + d1..dj would be (`logits_rows` hands the sampler a row per position whose output
tokens already end with those drafts, so penalties, min_tokens, top-k/top-p/min-p and
logprobs apply per position), then

    accepted = d1..dm, the longest prefix with d_{j+1} == token sampled at row j
    emitted  = accepted + [token sampled at row m]       (row k's: the bonus token)

Greedy rows accept while the draft is the argmax (a greedy draft model's q is one-hot too).
Sampled rows are rejection sampling: accept d with probability min(1, p(d) / q(d)), on
rejection draw from the residual max(0, p - q) renormalised, so every emitted token has the
target's distribution p. Two proposals:

  - n-gram drafts are deterministic, q one-hot at d: accept with probability p(d), on
    rejection draw from p with d zeroed. Sampling the row from p as a plain decode does and
    keeping d when the sample equals it is exactly that, and draws the same numbers as a
    plain decode: a seeded request's generator is rewound to the rows it used
    (`Sampler.rewind`), so the same seed gives the same tokens with speculation on or off
    (bitwise so in batch-invariant mode).
  - a draft model's drafts are drawn from its own q (`proposals` hands it to the sampler
    per row, `sampler.rejection_tokens` applies the rule). The row's token is then d or a
    token of the residual (never d), so the comparison below still finds the rejection. The
    same seed gives the same tokens again, not those of a run without speculation.

Under a grammar, row j is masked by the grammar's state after d1..dj (the step's
`StepGrammar` gives a request 1 + k mask rows; its drafts were cut to ones the grammar
accepts), so the comparison and the rejection rule above see the masked p, and every
emitted token keeps the grammar.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from carpool.core.scheduler_output import ScheduledRequest
from carpool.outputs import PositionLogprobs
from carpool.runner.sampler import Proposals


@dataclass
class Verified:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    accepted_draft_ids: dict[str, list[int]] = field(default_factory=dict)
    # per request, one per emitted token (accepted drafts, then the sampled token), if asked
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    num_rows_used: dict[str, int] = field(default_factory=dict)  # per speculating request


def logits_rows(sampled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """One request per logits row: itself without drafts; with k drafts, k + 1 rows, row j's
    output tokens ending with the first j drafts (copied only where a knob reads them)."""
    rows = []
    for request in sampled:
        drafts = request.draft_token_ids
        if not drafts:
            rows.append(request)
            continue
        params = request.sampling_params
        reads_outputs = params.has_penalty or params.min_tokens > 0
        outputs = list(request.output_token_ids) if reads_outputs else request.output_token_ids
        for j in range(len(drafts) + 1):
            rows.append(ScheduledRequest(
                request.request_id, request.token_ids, request.num_computed_tokens,
                request.block_ids, True, params, request.prompt_token_ids,
                outputs + list(drafts[:j]) if reads_outputs and j else outputs))
    return rows


def proposals(sampled: list[ScheduledRequest],
              draft_probs: dict[str, torch.Tensor]) -> Proposals | None:
    """Per `logits_rows` row, the draft that follows it and the draft model's q for it, for
    the requests in `draft_probs` (None when there are none: n-gram drafts, greedy rows)."""
    if not draft_probs:
        return None
    first = next(iter(draft_probs.values()))
    num_rows = sum(1 + len(r.draft_token_ids) for r in sampled)
    draft_ids = torch.full((num_rows,), -1, dtype=torch.int64)
    probs = first.new_zeros(num_rows, first.shape[-1])
    row = 0
    for request in sampled:
        q = draft_probs.get(request.request_id)
        if q is not None:
            k = len(request.draft_token_ids)
            draft_ids[row:row + k] = torch.tensor(request.draft_token_ids, dtype=torch.int64)
            probs[row:row + k] = q
        row += 1 + len(request.draft_token_ids)
    return Proposals(draft_ids.to(probs.device), probs)


def verify(sampled: list[ScheduledRequest], row_tokens: list[int],
           row_logprobs: list[PositionLogprobs | None]) -> Verified:
    """Per request: its accepted drafts and its own next token, from the rows' samples (in
    `logits_rows` order)."""
    out = Verified()
    row = 0
    for request in sampled:
        drafts = request.draft_token_ids
        num_accepted = 0
        while num_accepted < len(drafts) and row_tokens[row + num_accepted] == drafts[
                num_accepted]:
            num_accepted += 1
        rid = request.request_id
        out.sampled_token_ids[rid] = row_tokens[row + num_accepted]
        if drafts:
            out.accepted_draft_ids[rid] = list(drafts[:num_accepted])
            out.num_rows_used[rid] = num_accepted + 1
        if row_logprobs[row] is not None:
            out.logprobs[rid] = row_logprobs[row:row + num_accepted + 1]
        row += len(drafts) + 1
    return out
