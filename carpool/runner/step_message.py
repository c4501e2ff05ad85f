"""What rank 0 sends the other tensor-parallel ranks each step: a `SchedulerOutput` as int64s.

A worker runs the forward only (rank 0 samples), so it needs, per request, the
tokens fed, how many are already cached, the block table, whether the last
row's logits are gathered, and how many rows' logits the request's prompt
logprobs take (the LM head is a collective: every rank computes the same
slices); plus the static baseline's padding count. No ids, strings or sampling
settings cross, and nothing is unpickled:

    [kind, num_requests, num_padding_tokens,
     per request: num_tokens, num_computed_tokens, num_blocks, logits rows (0: no
                  sample; 1 + k: the last k tokens are drafts), prompt_logprob_rows,
     every request's token ids, then every request's block ids]

`kind` is STEP, or SHUTDOWN (then nothing follows): the worker exits.
"""

from __future__ import annotations

import numpy as np
import torch

from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput
from carpool.runner.prompt_logprobs import wants_prompt_logprobs
from carpool.sampling_params import SamplingParams

STEP, SHUTDOWN = 0, 1
_HEADER, _PER_REQUEST = 3, 5
_WORKER_PARAMS = SamplingParams(temperature=0.0)  # never read: workers do not sample
# Workers compute prompt-logprob logits only for the collective; their values are dropped.
_WORKER_PROMPT_PARAMS = SamplingParams(temperature=0.0, prompt_logprobs=0)


def _prompt_logprob_rows(request: ScheduledRequest) -> int:
    """Rows of this step's chunk whose logits score a prompt token (see prompt_logprobs)."""
    if not wants_prompt_logprobs(request):
        return 0
    start = request.num_computed_tokens
    return min(start + len(request.token_ids), len(request.prompt_token_ids) - 1) - start


def encode_step(step: SchedulerOutput) -> torch.Tensor:
    """The int64 message for `step` (see the module docstring)."""
    requests = step.scheduled
    counts = [(len(r.token_ids), r.num_computed_tokens, len(r.block_ids), r.num_logits_rows,
               _prompt_logprob_rows(r)) for r in requests]
    parts = [np.array([STEP, len(requests), step.num_padding_tokens], dtype=np.int64),
             np.array(counts, dtype=np.int64).reshape(-1)]
    parts += [np.asarray(r.token_ids, dtype=np.int64) for r in requests]
    parts += [np.asarray(r.block_ids, dtype=np.int64) for r in requests]
    return torch.from_numpy(np.concatenate(parts))


def encode_shutdown() -> torch.Tensor:
    return torch.tensor([SHUTDOWN, 0, 0], dtype=torch.int64)


def decode_step(message: torch.Tensor) -> SchedulerOutput | None:
    """The step a message describes; None for SHUTDOWN. Request ids are their positions."""
    values = message.numpy()
    kind, num_requests, num_padding = (int(v) for v in values[:_HEADER])
    if kind == SHUTDOWN:
        return None
    if kind != STEP:
        raise ValueError(f"unknown tensor-parallel message kind {kind}")
    counts = values[_HEADER:_HEADER + _PER_REQUEST * num_requests].reshape(-1, _PER_REQUEST)
    offset = _HEADER + _PER_REQUEST * num_requests
    token_ids = []
    for num_tokens in counts[:, 0]:
        token_ids.append(values[offset:offset + num_tokens].tolist())
        offset += num_tokens
    scheduled = []
    for i, (tokens, (_, num_computed, num_blocks, sample, prompt_rows)) in enumerate(
            zip(token_ids, counts)):
        extra = {}
        if prompt_rows:  # a prompt whose scored positions end where rank 0's does
            extra = dict(sampling_params=_WORKER_PROMPT_PARAMS,
                         prompt_token_ids=[0] * int(num_computed + prompt_rows + 1))
        if sample > 1:  # its drafts: the worker computes the same logits rows
            extra["draft_token_ids"] = tokens[len(tokens) - int(sample) + 1:]
        scheduled.append(ScheduledRequest(str(i), tokens, int(num_computed),
                                          values[offset:offset + num_blocks].tolist(),
                                          bool(sample), **{"sampling_params": _WORKER_PARAMS,
                                                           **extra}))
        offset += num_blocks
    return SchedulerOutput(scheduled=scheduled, num_padding_tokens=num_padding)
