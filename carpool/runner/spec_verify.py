"""Verify a step's draft tokens: keep those the target model would have produced itself.

A request scheduled with k drafts d1..dk feeds [t, d1, .., dk] and gets k + 1 logits rows;
row j predicts the token after d1..dj. Each row is sampled exactly as a plain decode with
outputs + d1..dj would be (`logits_rows` hands the sampler a row per position whose output
tokens already end with those drafts, so penalties, min_tokens, top-k/top-p/min-p and
logprobs apply per position), then

    accepted = d1..dm, the longest prefix with d_{j+1} == token sampled at row j
    emitted  = accepted + [token sampled at row m]       (row k's: the bonus token)

Greedy rows accept while the draft is the argmax. For sampled rows this is rejection
sampling with a deterministic proposal (n-gram drafts: q one-hot): d is accepted with
probability p(d), and on rejection the row's token is drawn from p given "not d", i.e. p
with d zeroed and renormalised; so every emitted token has the target's distribution.
Each row draws one uniform number as a plain decode does, and a seeded request's generator
is rewound to the rows it used (`rewind_seeded`), so the same seed gives the same tokens
with speculation on or off (bitwise so in batch-invariant mode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from carpool.core.scheduler_output import ScheduledRequest
from carpool.outputs import PositionLogprobs


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
