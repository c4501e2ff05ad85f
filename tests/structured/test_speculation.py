"""Grammar masks under speculative decoding, against llguidance's own per-matcher masks: the
drafts a grammar lets a step verify, one mask per verified position, the sampler's use of a
request's consecutive mask rows; the matcher is left where it was every time."""

from __future__ import annotations

import numpy as np
import torch

from carpool.core.scheduler_output import ScheduledRequest
from carpool.runner.sampler import apply_grammar_bitmask
from carpool.sampling_params import SamplingParams, StructuredOutputsParams
from carpool.structured.bitmask import BitmaskFiller
from carpool.structured.speculation import StepGrammar, accepted_drafts
from tests.structured.test_bitmask import EOS, VOCAB, _compiler

CHOICE = StructuredOutputsParams(choice=["alpha beta gamma", "alpha beta delta"])


def _own_mask(matcher, prefix: list[int], num_words: int) -> np.ndarray:
    """llguidance's mask after `prefix`, on a copy."""
    copy = matcher.deep_copy()
    if prefix:
        assert copy.consume_tokens(prefix)
    return np.frombuffer(copy.compute_bitmask(), dtype=np.int32)[:num_words]


def test_drafts_are_cut_at_a_refused_token_and_before_the_one_completing_the_grammar():
    compiler = _compiler()
    matcher = compiler.matcher(CHOICE)
    tokens = compiler.tokenizer.tokenize_str("alpha beta gamma")
    assert len(tokens) >= 3
    before = matcher.compute_bitmask()
    # the whole text completes the grammar: its last token is left for the target to sample
    assert accepted_drafts(matcher, tokens) == len(tokens) - 1
    assert accepted_drafts(matcher, tokens + [EOS[0]]) == len(tokens) - 1
    refused = next(t for t in range(VOCAB) if matcher.validate_tokens([tokens[0], t]) == 1)
    assert accepted_drafts(matcher, [tokens[0], refused, *tokens[2:]]) == 1
    assert accepted_drafts(matcher, [refused]) == 0 and accepted_drafts(matcher, []) == 0
    # the matcher is where it was
    assert not matcher.is_stopped() and not matcher.is_error()
    assert matcher.compute_bitmask() == before
    # an accepting grammar: EOS completes it, so it is cut, not the digits before it
    digits = compiler.matcher(StructuredOutputsParams(regex="[0-9]+"))
    twelve = compiler.tokenizer.tokenize_str("1212")
    assert accepted_drafts(digits, twelve + [EOS[0]]) == len(twelve)
    stopped = compiler.matcher(CHOICE)
    assert stopped.consume_tokens(tokens) and stopped.is_stopped()
    assert accepted_drafts(stopped, [EOS[0]]) == 0


def test_a_speculating_row_gets_one_mask_per_position_after_each_draft():
    compiler = _compiler()
    choice = compiler.matcher(CHOICE)
    regex = compiler.matcher(StructuredOutputsParams(regex="[0-9]{2}-[a-z]{2}"))
    drafts = compiler.tokenizer.tokenize_str("alpha beta gamma")[:-1]
    filler = BitmaskFiller(VOCAB, EOS)
    result = filler.fill([("a", regex), ("b", choice)], {"b": drafts})
    assert result.request_ids == ("a",) + ("b",) * (1 + len(drafts))
    assert np.array_equal(result.bitmask[0], _own_mask(regex, [], filler.num_words))
    for j in range(len(drafts) + 1):
        assert np.array_equal(result.bitmask[1 + j],
                              _own_mask(choice, drafts[:j], filler.num_words)), j
    assert not choice.is_stopped() and choice.validate_tokens(drafts) == len(drafts)
    # the same, begun on the filler's thread by a step's StepGrammar; and the masks a draft
    # model draws under: the position after its drafts so far
    grammar = StepGrammar(filler, {"a": regex, "b": choice})
    grammar.start({"b": drafts})
    assert np.array_equal(grammar.result().bitmask, result.bitmask)
    after = grammar.masks_after([("b", drafts[:2]), ("a", [])])
    assert np.array_equal(after.bitmask[0], _own_mask(choice, drafts[:2], filler.num_words))
    assert np.array_equal(after.bitmask[1], result.bitmask[0])
    assert grammar.accepted_drafts("b", drafts) == len(drafts)
    assert np.array_equal(_own_mask(choice, [], filler.num_words), result.bitmask[1])


def test_the_sampler_masks_a_requests_rows_in_order():
    """A speculating request's 1 + k logits rows take its 1 + k mask rows in order; other
    requests' rows are untouched."""
    compiler = _compiler()
    matcher = compiler.matcher(CHOICE)
    drafts = compiler.tokenizer.tokenize_str("alpha beta")
    bitmask = BitmaskFiller(VOCAB, EOS).fill([("b", matcher)], {"b": drafts})
    params = SamplingParams()
    requests = [ScheduledRequest("a", [1], 0, [0], True, params)] + [
        ScheduledRequest("b", [1, *drafts], 0, [0], True, params)] * (1 + len(drafts)) + [
        ScheduledRequest("c", [1], 0, [0], True, params)]
    logits = torch.randn(len(requests), VOCAB)
    before = logits.clone()
    apply_grammar_bitmask(logits, requests, bitmask)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[-1], before[-1])
    allowed = torch.from_numpy(bitmask.allowed(VOCAB).copy())
    for j in range(1 + len(drafts)):
        row = logits[1 + j]
        assert torch.equal(row[allowed[j]], before[1 + j][allowed[j]])
        assert bool(torch.isinf(row[~allowed[j]]).all())
    assert not torch.equal(allowed[0], allowed[1])  # the positions' masks differ
