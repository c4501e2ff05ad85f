"""Each sampling knob on hand-made logits, batched; seeds reproduce whatever the batch."""

from __future__ import annotations

import math

import pytest
import torch

from carpool.core.scheduler_output import ScheduledRequest
from carpool.runner.penalties import apply_penalties
from carpool.runner.sampler import CDF_BLOCK, Sampler, draw_by_inverse_cdf, greedy_ids
from carpool.runner.truncation import TOP_CANDIDATES, _cut_sorted, apply_top_k_top_p
from carpool.sampling_params import SamplingParams

CPU = torch.device("cpu")
EOS = 0


def _req(request_id="r", prompt=(1,), outputs=(), **params) -> ScheduledRequest:
    return ScheduledRequest(request_id, [1], 0, [0], True, SamplingParams(**params),
                            list(prompt), list(outputs))


def _logits_from_probs(probs, rows=1) -> torch.Tensor:
    return torch.tensor([probs] * rows).log()


def _draw(logits, requests, seed=0):
    return Sampler(CPU, (EOS,), seed).sample(logits, requests).token_ids


def test_greedy_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    reqs = [_req(f"r{i}", temperature=0.0) for i in range(5)]
    assert _draw(logits, reqs) == logits.argmax(dim=-1).tolist()


def test_temperature_draws_follow_the_distribution():
    probs = [0.1, 0.6, 0.3]
    tokens = _draw(_logits_from_probs(probs, 3000), [_req(f"r{i}") for i in range(3000)])
    freq = [tokens.count(t) / 3000 for t in range(3)]
    assert all(abs(f - p) < 0.04 for f, p in zip(freq, probs)), freq
    cold = _draw(_logits_from_probs(probs, 200), [_req(f"r{i}", temperature=0.05)
                                                  for i in range(200)])
    assert set(cold) == {1}


def _weights_over_blocks() -> torch.Tensor:
    """A row over 2.5 blocks: mass in the first and the last block, a block of zeros
    between, zeros at the row's end (and the padding of the last block)."""
    weights = torch.zeros(CDF_BLOCK * 2 + CDF_BLOCK // 2)
    weights[[0, 7, CDF_BLOCK - 1, 2 * CDF_BLOCK + 3, 2 * CDF_BLOCK + 10]] = torch.tensor(
        [0.05, 0.25, 0.2, 0.4, 0.1])
    return weights


def test_inverse_cdf_draws_follow_the_weights_across_blocks():
    weights = _weights_over_blocks()
    rows = 20_000
    uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens = draw_by_inverse_cdf(weights.expand(rows, -1).contiguous() * 3.0, uniforms)
    counts = torch.bincount(tokens, minlength=weights.numel()).double() / rows
    drawn = counts.nonzero().flatten().tolist()
    assert drawn == weights.nonzero().flatten().tolist()  # only positive weights, all of them
    assert torch.allclose(counts, weights.double(), atol=0.015), counts[drawn]


def test_inverse_cdf_never_draws_a_zero_weight_at_the_ends():
    weights = _weights_over_blocks().expand(3, -1).contiguous()
    uniforms = torch.tensor([0.0, 1.0 - 2.0 ** -53, 0.6], dtype=torch.float64)
    assert draw_by_inverse_cdf(weights, uniforms).tolist() == [0, 2 * CDF_BLOCK + 10,
                                                               2 * CDF_BLOCK + 3]
    # Rounding past a row's last positive weight still draws that weight.
    assert draw_by_inverse_cdf(weights[:1], torch.tensor([1.5], dtype=torch.float64)).tolist() \
        == [2 * CDF_BLOCK + 10]


def test_top_k_top_p_among_candidates_keeps_what_a_full_sort_keeps():
    vocab = 3 * TOP_CANDIDATES
    gen = torch.Generator().manual_seed(0)
    sharp = torch.randn(6, vocab, generator=gen) * 4  # top_p prefixes within the candidates
    flat = torch.randn(2, vocab, generator=gen) * 0.01  # top_p 0.9 needs ~2,800 tokens
    logits = torch.cat([sharp, flat])
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=50, top_p=0.8),
              SamplingParams(top_k=TOP_CANDIDATES + 500), SamplingParams(),  # untouched
              SamplingParams(top_k=3), SamplingParams(top_p=0.5),
              SamplingParams(top_p=0.9), SamplingParams(top_k=2000, top_p=0.95)]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    expected = _cut_sorted(logits, *logits.sort(dim=-1, descending=True), top_k, top_p)
    got = apply_top_k_top_p(logits, params)
    assert torch.equal(got.isfinite(), expected.isfinite())
    assert torch.equal(got[got.isfinite()], expected[expected.isfinite()])
    kept = got.isfinite().sum(dim=-1).tolist()
    assert kept[3] == vocab and kept[4] == 3 and kept[2] == TOP_CANDIDATES + 500
    assert kept[6] > TOP_CANDIDATES  # the flat row's prefix came from the full sort
    # Every row inside its candidates (the common case): one topk, no sort.
    rows = [0, 1, 4]
    got = apply_top_k_top_p(logits[rows], [params[i] for i in rows])
    assert torch.equal(got, expected[rows])


@pytest.mark.parametrize("knob, allowed", [
    (dict(top_k=1), {1}),
    (dict(top_k=2), {1, 2}),
    (dict(top_p=0.45), {1}),  # the top token alone (0.5) covers 0.45
    (dict(top_p=0.75), {1, 2}),  # 0.5 + 0.3 covers 0.75
    (dict(min_p=0.5), {1, 2}),  # keep p >= 0.5 * 0.5
    (dict(min_p=0.9), {1}),
])
def test_truncation_knobs(knob, allowed):
    probs = [0.05, 0.5, 0.3, 0.1, 0.05]
    tokens = _draw(_logits_from_probs(probs, 400), [_req(f"r{i}", **knob) for i in range(400)])
    assert set(tokens) == allowed


def test_knobs_apply_per_row():
    probs = [0.05, 0.5, 0.3, 0.1, 0.05]
    reqs = [_req(f"r{i}", top_k=1 if i % 2 else 0) for i in range(400)]
    tokens = _draw(_logits_from_probs(probs, 400), reqs)
    assert set(tokens[1::2]) == {1}
    assert len(set(tokens[0::2])) > 2


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    apply_penalties(logits, [_req(prompt=[0], outputs=[1], repetition_penalty=2.0)])
    assert logits.tolist() == [[1.0, -2.0, 3.0, 0.5]]


def test_presence_and_frequency_penalties_count_outputs_only():
    logits = torch.zeros(1, 4)
    apply_penalties(logits, [_req(prompt=[3, 3], outputs=[1, 1, 2],
                                  presence_penalty=0.5, frequency_penalty=0.25)])
    assert logits.tolist() == [[0.0, -1.0, -0.75, 0.0]]


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[0.0, 2.0, 1.5, 0.0]] * 2)
    reqs = [_req("a", outputs=[1], temperature=0.0, repetition_penalty=2.0),
            _req("b", outputs=[1], temperature=0.0)]
    assert _draw(logits, reqs) == [2, 1]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[5.0, 1.0, 4.0, 3.0]] * 4)
    reqs = [_req("a", outputs=[], temperature=0.0, min_tokens=2, stop_token_ids=(2,)),
            _req("b", outputs=[7, 7], temperature=0.0, min_tokens=2, stop_token_ids=(2,)),
            _req("c", outputs=[], temperature=0.0, min_tokens=2, ignore_eos=True),
            _req("d", outputs=[], temperature=0.0)]
    assert _draw(logits, reqs) == [3, 0, 0, 0]


def test_same_seed_same_tokens_whatever_the_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 100, generator=gen)
    seeded = _req("s", seed=1234)
    others = [_req("o1"), _req("o2", seed=9), _req("o3", temperature=0.0)]

    def run(batch_logits, batch, sampler_seed, steps=5):
        sampler = Sampler(CPU, (EOS,), sampler_seed)
        row = [r.request_id for r in batch].index("s")
        return [sampler.sample(batch_logits, batch).token_ids[row] for _ in range(steps)]

    alone = run(logits[:1], [seeded], sampler_seed=0)
    in_batch = run(torch.cat([logits[1:3], logits[:1], logits[3:]]),
                   [others[0], others[1], seeded, others[2]], sampler_seed=99)
    assert alone == in_batch
    assert len(set(alone)) > 1  # it did sample, not argmax
    assert run(logits[:1], [_req("s", seed=4321)], sampler_seed=0) != alone


def test_finished_requests_drop_their_generator():
    sampler = Sampler(CPU, (EOS,), 0)
    sampler.sample(torch.zeros(2, 10), [_req("a", seed=1), _req("b", seed=2)])
    assert sampler.num_request_generators == 2
    sampler.free(["a", "unknown"])
    assert sampler.num_request_generators == 1


def test_logprobs_are_raw_with_chosen_token_and_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0]])
    reqs = [_req("a", temperature=0.0, logprobs=2, repetition_penalty=10.0, outputs=[1]),
            _req("b", temperature=0.0)]
    out = Sampler(CPU, (EOS,), 0).sample(logits, reqs)
    assert out.token_ids == [2, 1]  # the penalty moved a's choice off token 1
    assert out.logprobs[1] is None
    entry = out.logprobs[0]
    expected = torch.log_softmax(logits[0], dim=-1)  # raw: before the penalty
    assert set(entry) == {1, 2}  # top-2 is {1, 2}; the chosen token 2 is among them
    assert entry[2].rank == 2 and entry[1].rank == 1
    assert math.isclose(entry[2].logprob, expected[2].item(), abs_tol=1e-6)


def test_logprobs_zero_returns_only_the_chosen_token():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = Sampler(CPU, (EOS,), 0).sample(logits, [_req(temperature=0.0, logprobs=0,
                                                       min_tokens=1, stop_token_ids=(1,))])
    assert out.token_ids == [2]
    assert list(out.logprobs[0]) == [2] and out.logprobs[0][2].rank == 2


def test_temperature_below_the_epsilon_is_greedy():
    """1e-40 survives float64 validation but overflows float32 logits: it is greedy instead."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    reqs = [_req(f"r{i}", temperature=t, seed=i)
            for i, t in enumerate((1e-40, 1e-6, 5e-324, 0.0))]
    assert all(r.sampling_params.is_greedy for r in reqs)
    assert _draw(logits, reqs) == logits.argmax(dim=-1).tolist()
    mixed = reqs[:1] + [_req("sampled", temperature=1.0)]
    assert _draw(logits[:2], mixed)[0] == int(logits[0].argmax())


def test_overflowing_penalty_still_samples_the_boosted_token():
    """repetition_penalty 1e-37 turns a seen positive logit into +inf in float32: the draw
    takes that token, not token 0 through NaN probabilities."""
    logits = torch.full((1, 50), -1.0)
    logits[0, 7] = 100.0
    reqs = [_req(prompt=(7,), temperature=1.0, repetition_penalty=1e-37)]
    assert _draw(logits.clone(), reqs) == [7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ids_pick_what_argmax_picks(dtype):
    """First of equal maxima, NaN above everything, +inf, all -inf rows; and random rows."""
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1.0, 3.0, 3.0, 0.0], [nan, 1.0, nan, 2.0], [-inf] * 4,
                         [1.0, inf, inf, 2.0], [0.0, 0.0, 0.0, 0.0]], dtype=dtype)
    assert torch.equal(greedy_ids(rows), rows.argmax(dim=-1))
    torch.manual_seed(0)
    logits = torch.randn(37, 4099).round(decimals=1).to(dtype)  # many ties
    assert torch.equal(greedy_ids(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("change, plain", [
    ({}, True), ({"temperature": 1e-6}, True), ({"temperature": 0.7}, False),
    ({"logprobs": 0}, False), ({"min_tokens": 1}, False), ({"repetition_penalty": 1.1}, False),
    ({"presence_penalty": 0.5}, False), ({"frequency_penalty": -0.5}, False)])
def test_plain_greedy_means_greedy_with_nothing_to_apply_first(change, plain):
    assert SamplingParams(**{"temperature": 0.0, **change}).is_plain_greedy is plain


def test_one_row_with_processing_takes_the_whole_batch_off_the_argmax_fast_path():
    logits = torch.tensor([[0.0, 5.0, 1.0], [9.0, 1.0, 2.0]])  # row 1's argmax is EOS
    reqs = [_req("a", temperature=0.0), _req("b", temperature=0.0, min_tokens=1)]
    assert _draw(logits, reqs) == [1, 2]
