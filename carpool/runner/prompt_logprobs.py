"""Logprobs of prompt tokens: the logits of every prompt position, not only the last.

A prefill chunk feeds positions `[c, c + n)`; the logits at position `p` score
prompt token `p + 1`, so the chunk yields the logprobs of tokens
`c + 1 .. min(c + n, P - 1)` (P prompt tokens; the last position's logits
score the first *output* token, which the sampler handles). Every chunk of a
chunked prefill contributes its share; the scheduler never serves such a
request from the prefix cache, so no position is skipped.

Logits are float32 and computed in slices of rows, so a 2048-token chunk over
a 150k vocabulary never holds more than `_ROWS_PER_SLICE` rows of logits.
"""

from __future__ import annotations

import torch

from carpool.core.scheduler_output import ScheduledRequest
from carpool.outputs import PromptLogprobs

_ROWS_PER_SLICE = 256


def wants_prompt_logprobs(req: ScheduledRequest) -> bool:
    """Whether this step's chunk of `req` scores any prompt token."""
    return (req.sampling_params.prompt_logprobs is not None
            and req.num_computed_tokens < len(req.prompt_token_ids) - 1)


def chunk_prompt_logprobs(compute_logits, hidden: torch.Tensor, req: ScheduledRequest,
                          first_row: int) -> PromptLogprobs:
    """The prompt logprobs one scheduled chunk yields; `hidden` is the step's packed hidden
    states and `first_row` the chunk's first row in it.

        rows:    first_row ... first_row + num_rows - 1
        scores:  prompt[c + 1] ... prompt[c + num_rows]
    """
    start = req.num_computed_tokens
    end = min(start + len(req.token_ids), len(req.prompt_token_ids) - 1)
    num_top = req.sampling_params.prompt_logprobs
    targets = torch.as_tensor(list(req.prompt_token_ids[start + 1:end + 1]),
                              device=hidden.device, dtype=torch.int64)
    chosen, ranks, top_values, top_ids = [], [], [], []
    for lo in range(0, end - start, _ROWS_PER_SLICE):
        hi = min(lo + _ROWS_PER_SLICE, end - start)
        logprobs = torch.log_softmax(
            compute_logits(hidden[first_row + lo:first_row + hi]).float(), dim=-1)  # (R, V)
        picked = logprobs.gather(1, targets[lo:hi, None])  # (R, 1)
        chosen.extend(picked[:, 0].tolist())
        ranks.extend(((logprobs > picked).sum(dim=-1) + 1).tolist())
        if num_top:
            values, ids = logprobs.topk(num_top, dim=-1)
            top_values.extend(tuple(row) for row in values.tolist())
            top_ids.extend(tuple(row) for row in ids.tolist())
    if not num_top:
        top_values = top_ids = [()] * len(chosen)
    return PromptLogprobs(start=start + 1, token_ids=tuple(targets.tolist()),
                          logprobs=tuple(chosen), ranks=tuple(ranks),
                          top_token_ids=tuple(top_ids), top_logprobs=tuple(top_values))
