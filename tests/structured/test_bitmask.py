"""The step's bitmask against llguidance's own per-matcher mask, and the sampler's use of it:
constrained rows lose exactly the disallowed tokens, other rows are untouched."""

from __future__ import annotations

import numpy as np
import torch

from carpool.core.scheduler_output import ScheduledRequest
from carpool.default_model_path import default_model_path
from carpool.engine.tokenizer import load_tokenizer
from carpool.runner.sampler import apply_grammar_bitmask
from carpool.sampling_params import SamplingParams, StructuredOutputsParams
from carpool.structured.bitmask import BitmaskFiller
from carpool.structured.compiler import GrammarCompiler, estimated_bytes
from carpool.structured.grammar import grammar_text

VOCAB = 4096
EOS = (0,)


def _compiler(cache_memory: int = 2**20) -> GrammarCompiler:
    return GrammarCompiler(load_tokenizer(default_model_path()), VOCAB, EOS, cache_memory)


def test_filled_rows_equal_each_matchers_own_mask_and_stopped_rows_allow_only_eos():
    compiler = _compiler()
    regex = compiler.matcher(StructuredOutputsParams(regex="[0-9]{2}"))
    choice = compiler.matcher(StructuredOutputsParams(choice=["alpha", "beta"]))
    done = compiler.matcher(StructuredOutputsParams(choice=["x"]))
    assert done.consume_tokens(compiler.tokenizer.tokenize_str("x"))
    assert done.is_stopped() or done.is_accepting()
    done.consume_token(EOS[0])
    filler = BitmaskFiller(VOCAB, EOS)
    result = filler.start([("a", regex), ("b", choice), ("c", done)]).result()
    assert result.request_ids == ("a", "b", "c")
    for row, matcher in enumerate((regex, choice)):
        expected = np.frombuffer(matcher.deep_copy().compute_bitmask(), dtype=np.int32)
        assert np.array_equal(result.bitmask[row], expected[:filler.num_words])
        assert not expected[filler.num_words:].any()  # llguidance pads its own buffer
    allowed = result.allowed(VOCAB)
    assert allowed[2].nonzero()[0].tolist() == list(EOS)
    digits = set(allowed[0].nonzero()[0].tolist())
    assert digits and all(compiler.tokenizer.decode_str([t]).isdigit() for t in digits)


def test_sampler_masks_only_the_named_rows():
    compiler = _compiler()
    matcher = compiler.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    bitmask = BitmaskFiller(VOCAB, EOS).fill([("b", matcher)])
    requests = [ScheduledRequest(rid, [1], 0, [0], True, SamplingParams()) for rid in "abc"]
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    apply_grammar_bitmask(logits, requests, bitmask)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.from_numpy(bitmask.allowed(VOCAB)[0])
    assert torch.equal(logits[1][allowed], before[1][allowed])
    assert bool(torch.isinf(logits[1][~allowed]).all()) and 0 < int(allowed.sum()) < VOCAB


def test_compile_cache_hands_out_fresh_matchers():
    compiler = _compiler()
    first = compiler.matcher(StructuredOutputsParams(regex="ab"))
    assert first.consume_tokens(compiler.tokenizer.tokenize_str("a"))
    again = compiler.matcher(StructuredOutputsParams(regex="ab"))  # from the cache
    assert compiler.num_cached == 1
    assert again.consume_tokens(compiler.tokenizer.tokenize_str("ab"))


def test_compile_cache_is_bounded_by_bytes_least_recently_used_out():
    small = [StructuredOutputsParams(regex=r) for r in ("a", "b", "c")]
    big = StructuredOutputsParams(choice=[f"option {i}" for i in range(400)])
    sizes = [estimated_bytes(grammar_text(p)) for p in small]
    compiler = _compiler(cache_memory=sum(sizes) + 10)  # the three small ones fit
    for params in small:
        compiler.matcher(params)
    assert compiler.num_cached == 3 and compiler.num_cached_bytes == sum(sizes)
    compiler.matcher(small[0])  # used again: now the most recent
    compiler.matcher(StructuredOutputsParams(regex="d"))  # one must go: "b", the oldest
    assert _cached(compiler) == ["c", "a", "d"]
    assert compiler.num_cached_bytes <= compiler.cache_memory

    assert estimated_bytes(grammar_text(big)) > compiler.cache_memory
    compiler.matcher(big)  # served, but larger than the bound alone: not kept, none evicted
    assert _cached(compiler) == ["c", "a", "d"]

    room = _compiler(cache_memory=estimated_bytes(grammar_text(big)))
    for params in small:
        room.matcher(params)
    room.matcher(big)  # evicts every small one, by bytes, not by count
    assert room.num_cached == 1 and room.num_cached_bytes == estimated_bytes(grammar_text(big))


def _cached(compiler: GrammarCompiler) -> list[str]:
    """The cached one-letter regexes, least recently used first."""
    return [params.regex or "?" for params in compiler._templates]
