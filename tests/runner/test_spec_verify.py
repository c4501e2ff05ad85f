"""Verifying drafts with the real sampler: greedy rows keep the drafts the argmax agrees with;
sampled rows keep the target's distribution at every position (chi-square); per-position
rows see the drafts before them; a seeded request's generator ends where a plain decode's
would."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from carpool.core.scheduler_output import ScheduledRequest
from carpool.runner import spec_verify
from carpool.runner.sampler import Sampler
from carpool.sampling_params import SamplingParams
from carpool.structured.bitmask import GrammarBitmask

CPU = torch.device("cpu")
SIGNIFICANCE = 1e-3  # a correct sampler fails a chi-square test this rarely


def row(request_id="r", drafts=(), outputs=(5,), **params) -> ScheduledRequest:
    return ScheduledRequest(request_id, [1, *drafts], 4, [0], True, SamplingParams(**params),
                            [1, 2, 3, 4], list(outputs), list(drafts))


def sample_and_verify(sampler, logits, requests):
    rows = spec_verify.logits_rows(requests)
    out = sampler.sample(logits, rows)
    return spec_verify.verify(requests, out.token_ids, out.logprobs)


def test_greedy_rows_accept_while_the_argmax_agrees():
    logits = torch.full((8, 10), -1.0)
    for position, best in enumerate([3, 4, 9, 6, 2, 8, 1, 7]):
        logits[position, best] = 1.0
    requests = [row("a", drafts=[3, 4, 5], temperature=0.0),  # rows 0-3: 3 4 kept, then 9
                row("b", temperature=0.0),                    # row 4, no drafts
                row("c", drafts=[8, 1], temperature=0.0)]     # rows 5-7: all kept + bonus 7
    verified = sample_and_verify(Sampler(CPU, (0,)), logits, requests)
    assert verified.sampled_token_ids == {"a": 9, "b": 2, "c": 7}
    assert verified.accepted_draft_ids == {"a": [3, 4], "c": [8, 1]}
    assert verified.num_rows_used == {"a": 3, "c": 3}


def test_each_position_sees_the_drafts_before_it():
    """A repetition penalty at position j covers the first j drafts (and not later ones)."""
    requests = [row("a", drafts=[7, 8], outputs=[5], repetition_penalty=2.0, logprobs=1,
                    temperature=0.0)]
    rows = spec_verify.logits_rows(requests)
    assert [list(r.output_token_ids) for r in rows] == [[5], [5, 7], [5, 7, 8]]
    assert requests[0].output_token_ids == [5]  # the request's own list untouched
    logits = torch.zeros(3, 10)
    logits[:, 7] = 1.0  # 7 is everyone's argmax until the penalty halves it
    logits[:, 8] = 0.9
    logits[:, 9] = 0.6
    verified = sample_and_verify(Sampler(CPU, (0,)), logits, requests)
    # row 0: 7 (accepted), row 1: 7 halved -> 8 (accepted), row 2: 7 and 8 halved -> 9
    assert verified.accepted_draft_ids == {"a": [7, 8]}
    assert verified.sampled_token_ids == {"a": 9}
    assert len(verified.logprobs["a"]) == 3


def count_emitted(counts: list[Counter], requests, verified) -> None:
    """Add each request's emitted tokens (accepted drafts, then its own) by position."""
    for request in requests:
        rid = request.request_id
        for position, token in enumerate([*verified.accepted_draft_ids[rid],
                                          verified.sampled_token_ids[rid]]):
            counts[position][token] += 1


def target_distribution(logits: np.ndarray, temperature: float, top_k: int = 0,
                        top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """What a plain decode samples from, written out: temperature, min_p, top_k, top_p."""
    z = logits / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    keep = probs >= min_p * probs.max()
    order = np.argsort(-z, kind="stable")
    if top_k:
        keep[order[top_k:]] = False
    kept = np.where(keep, probs, 0.0)
    kept /= kept.sum()
    mass_before = np.cumsum(kept[order]) - kept[order]
    keep[order[mass_before >= top_p]] = False
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4),
                                    dict(temperature=1.3, top_p=0.8, min_p=0.05)])
def test_sampled_tokens_keep_the_targets_distribution(params):
    """Each emitted position's frequencies, over many requests, match the distribution a plain
    decode samples from there (chi-square at SIGNIFICANCE), a likely and an unlikely draft."""
    vocab, batch, num_batches = 8, 1000, 6
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 1.5
    drafts = [int(logits[0].argmax()), int(logits[1].argmin())]
    counts = [Counter(), Counter(), Counter()]  # emitted tokens at positions 0, 1, 2
    sampler = Sampler(CPU, (0,), seed=2)
    for b in range(num_batches):
        requests = [row(f"t{b}-{i}", drafts=drafts, **params) for i in range(batch)]
        verified = sample_and_verify(sampler, logits.repeat(batch, 1), requests)
        count_emitted(counts, requests, verified)
    for position, counter in enumerate(counts):
        total = counter.total()
        if total < 200:
            continue  # (the unlikely second draft is rarely accepted: few third positions)
        expected = target_distribution(logits[position].double().numpy(), **params)
        support = expected > 0
        observed = np.array([counter.get(t, 0) for t in range(vocab)])
        assert observed[~support].sum() == 0  # nothing outside top-k / top-p / min-p
        _, p_value = chisquare(observed[support], expected[support] * total)
        assert p_value > SIGNIFICANCE, (position, observed, expected * total)
    # the first draft is accepted sometimes, not always: both branches were exercised
    assert 0 < counts[1].total() < batch * num_batches


def test_a_seeded_generator_ends_where_a_plain_decode_leaves_it():
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    request = row("s", drafts=[1, 2, 3], seed=42, temperature=1.0)
    sampler = Sampler(CPU, (0,))
    states = sampler.seeded_states([request])
    verified = sample_and_verify(sampler, logits, [request])
    used = verified.num_rows_used["s"]
    sampler.rewind("s", 42, states["s"], used)
    after = sampler._uniforms([row("s", seed=42, temperature=1.0)])
    reference = torch.Generator().manual_seed(42)
    expected = [torch.rand(1, generator=reference, dtype=torch.float64)[0]
                for _ in range(used + 1)][-1]
    assert after[0] == expected


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4),
                                    dict(temperature=1.3, top_p=0.8, min_p=0.05)])
def test_draft_model_rejection_sampling_keeps_the_targets_distribution(params):
    """Drafts drawn from a draft model's q (a different distribution from the target's p,
    overlapping it partly) and verified with q: accept with min(1, p/q), else draw from the
    residual. Each emitted position's frequencies match p (chi-square at SIGNIFICANCE);
    with q ignored (drafts verified as if one-hot) the first position would be p too, but
    acceptance would be lower: both branches are exercised and acceptance beats sum(p*q)."""
    vocab, batch, num_batches, k = 8, 1000, 6, 2
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(k + 1, vocab, generator=generator) * 1.5
    draft_logits = logits[:k] + torch.randn(k, vocab, generator=generator)  # a fair draft
    target = [target_distribution(logits[j].double().numpy(), **params) for j in range(k + 1)]
    q = torch.tensor(np.stack([target_distribution(draft_logits[j].double().numpy(), **params)
                               for j in range(k)]), dtype=torch.float32)
    counts = [Counter() for _ in range(k + 1)]
    num_accepted_first = 0
    sampler = Sampler(CPU, (0,), seed=4)
    for b in range(num_batches):
        drafts = torch.stack([torch.multinomial(q[j], batch, replacement=True,
                                                generator=generator) for j in range(k)], 1)
        requests = [row(f"d{b}-{i}", drafts=drafts[i].tolist(), **params) for i in range(batch)]
        rows = spec_verify.logits_rows(requests)
        proposals = spec_verify.proposals(requests, {r.request_id: q for r in requests})
        out = sampler.sample(logits.repeat(batch, 1), rows, None, proposals)
        verified = spec_verify.verify(requests, out.token_ids, out.logprobs)
        for request in requests:
            rid = request.request_id
            accepted = verified.accepted_draft_ids[rid]
            num_accepted_first += bool(accepted)
            for position, token in enumerate([*accepted, verified.sampled_token_ids[rid]]):
                counts[position][token] += 1
    for position, counter in enumerate(counts):
        total = counter.total()
        if total < 200:
            continue
        expected = target[position]
        support = expected > 0
        observed = np.array([counter.get(t, 0) for t in range(vocab)])
        assert observed[~support].sum() == 0
        _, p_value = chisquare(observed[support], expected[support] * total)
        assert p_value > SIGNIFICANCE, (position, observed, expected * total)
    rate = num_accepted_first / (batch * num_batches)
    overlap = float(np.minimum(target[0], q[0].double().numpy()).sum())  # the optimum
    assert 0 < rate < 1
    assert rate == pytest.approx(overlap, abs=0.03)
    assert overlap > float((target[0] * q[0].double().numpy()).sum()) + 0.05


@pytest.mark.parametrize("masked_q", [True, False])
@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4)])
def test_rejection_sampling_under_a_grammar_keeps_the_masked_distribution(params, masked_q):
    """Under a grammar each verified position has its own mask (a `GrammarBitmask` row per
    position): every emitted token is one its position allows, and each position's
    frequencies match the masked target distribution (chi-square at SIGNIFICANCE), with the
    draft drawn under the masks (as the draft model does) or not (a disallowed draft has
    p = 0: always rejected)."""
    vocab, batch, num_batches, k = 8, 1000, 6, 2
    allowed = np.zeros((k + 1, vocab), dtype=bool)
    allowed[0, :6], allowed[1, 2:], allowed[2, 1::2] = True, True, True
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(k + 1, vocab, generator=generator) * 1.5
    masked = logits.masked_fill(torch.from_numpy(~allowed), float("-inf"))
    draft_logits = (masked if masked_q else logits)[:k] + torch.randn(k, vocab,
                                                                       generator=generator)
    target = [target_distribution(masked[j].double().numpy(), **params) for j in range(k + 1)]
    q = torch.tensor(np.stack([target_distribution(draft_logits[j].double().numpy(), **params)
                               for j in range(k)]), dtype=torch.float32)
    words = np.packbits(allowed, axis=1, bitorder="little").view(np.uint8)
    mask_rows = np.zeros((k + 1, 1), dtype=np.int32)
    mask_rows.view(np.uint8)[:, :words.shape[1]] = words
    counts = [Counter() for _ in range(k + 1)]
    sampler = Sampler(CPU, (0,), seed=5)
    for b in range(num_batches):
        drafts = torch.stack([torch.multinomial(q[j], batch, replacement=True,
                                                generator=generator) for j in range(k)], 1)
        requests = [row(f"g{b}-{i}", drafts=drafts[i].tolist(), **params) for i in range(batch)]
        bitmask = GrammarBitmask(tuple(r.request_id for r in requests for _ in range(k + 1)),
                                 np.tile(mask_rows, (batch, 1)))
        proposals = spec_verify.proposals(requests, {r.request_id: q for r in requests})
        out = sampler.sample(logits.repeat(batch, 1), spec_verify.logits_rows(requests),
                             bitmask, proposals)
        count_emitted(counts, requests,
                      spec_verify.verify(requests, out.token_ids, out.logprobs))
    for position, counter in enumerate(counts):
        total = counter.total()
        observed = np.array([counter.get(t, 0) for t in range(vocab)])
        assert observed[~allowed[position]].sum() == 0, (position, observed)
        if total < 200:
            continue
        expected = target[position]
        support = expected > 0
        _, p_value = chisquare(observed[support], expected[support] * total)
        assert p_value > SIGNIFICANCE, (position, observed, expected * total)


def test_draft_model_greedy_rows_accept_while_the_argmax_agrees():
    """A greedy request's q is not read: its drafts are kept while they are the argmax."""
    logits = torch.full((3, 10), -1.0)
    for position, best in enumerate([3, 4, 9]):
        logits[position, best] = 1.0
    request = row("g", drafts=[3, 5], temperature=0.0)
    q = torch.full((2, 10), 0.1)
    out = Sampler(CPU, (0,)).sample(logits, spec_verify.logits_rows([request]), None,
                                    spec_verify.proposals([request], {"g": q}))
    verified = spec_verify.verify([request], out.token_ids, out.logprobs)
    assert verified.accepted_draft_ids == {"g": [3]}
    assert verified.sampled_token_ids == {"g": 4}
