"""The int64 message rank 0 sends tensor-parallel workers carries everything a forward needs."""

from __future__ import annotations

import pytest
import torch

from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput
from carpool.runner.step_message import decode_step, encode_shutdown, encode_step
from carpool.sampling_params import SamplingParams


def test_a_step_round_trips_without_ids_or_sampling_settings():
    params = SamplingParams(temperature=0.7, top_k=5)
    step = SchedulerOutput(scheduled=[
        ScheduledRequest("req-a", [5, 6, 7], 0, [3, 9], False, params, prompt_token_ids=[5]),
        ScheduledRequest("req-b", [11], 40, [0, 1, 2], True, params),
    ], preempted_ids=["x"], finished_ids=["y"], num_padding_tokens=4)
    decoded = decode_step(encode_step(step))
    assert decoded.num_padding_tokens == 4
    assert [(list(r.token_ids), r.num_computed_tokens, list(r.block_ids), r.sample)
            for r in decoded.scheduled] == [([5, 6, 7], 0, [3, 9], False),
                                             ([11], 40, [0, 1, 2], True)]
    assert decode_step(encode_step(SchedulerOutput())).scheduled == []


def test_shutdown_and_unknown_kinds():
    assert decode_step(encode_shutdown()) is None
    with pytest.raises(ValueError, match="unknown tensor-parallel message kind 7"):
        decode_step(torch.tensor([7, 0, 0]))


def test_prompt_logprob_chunks_reach_workers_as_the_same_logit_rows():
    """The LM head is a collective: a worker must compute logits for exactly the rows rank 0
    scores a chunk's prompt tokens with, or the ranks fall out of step."""
    from carpool.runner.prompt_logprobs import wants_prompt_logprobs
    prompt = list(range(10, 30))  # 20 tokens: positions 0..18 score tokens 1..19
    params = SamplingParams(prompt_logprobs=2)
    chunks = [ScheduledRequest("a", prompt[:8], 0, [0], False, params, prompt_token_ids=prompt),
              ScheduledRequest("b", prompt[8:], 8, [0, 1], True, params, prompt_token_ids=prompt),
              ScheduledRequest("c", [7], 20, [0, 1], True, params, prompt_token_ids=prompt),
              ScheduledRequest("d", [1, 2], 0, [2], True, SamplingParams(),
                               prompt_token_ids=[1, 2])]
    decoded = decode_step(encode_step(SchedulerOutput(scheduled=chunks))).scheduled

    def rows(r):
        if not wants_prompt_logprobs(r):
            return None
        start = r.num_computed_tokens
        return start, min(start + len(r.token_ids), len(r.prompt_token_ids) - 1)

    assert [rows(r) for r in decoded] == [rows(r) for r in chunks] == [
        (0, 8), (8, 19), None, None]


def test_draft_tokens_reach_workers_as_the_same_logit_rows():
    """A speculating decode's 1 + k logits rows are a collective too: a worker computes
    exactly as many (its drafts are the last k tokens fed)."""
    params = SamplingParams(temperature=0.0)
    step = SchedulerOutput(scheduled=[
        ScheduledRequest("spec", [9, 4, 5, 6], 12, [0, 1], True, params, draft_token_ids=[4, 5, 6]),
        ScheduledRequest("plain", [8], 7, [2], True, params),
        ScheduledRequest("chunk", [1, 2, 3], 0, [3], False, params)])
    decoded = decode_step(encode_step(step)).scheduled
    assert [list(r.draft_token_ids) for r in decoded] == [[4, 5, 6], [], []]
    assert [r.num_logits_rows for r in decoded] == [r.num_logits_rows for r in step.scheduled] \
        == [4, 1, 0]
