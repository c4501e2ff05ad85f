"""Structured outputs under speculative decoding: drafts cut to what the grammar lets a step
verify, every verified position sampled under its own mask. Greedy outputs are token for
token those without speculation (JSON schema, regex, choice; n-gram and a draft model, also
under chunked prefill with preemption), each satisfies its grammar by `jsonschema`, `re`
and the choice list, and grammar requests alone move the acceptance counters, so none of
this passes with speculation silently off for them.

Prompts hold text the grammars allow, repeated, so n-gram lookups find drafts; the draft
model is the target itself (drafting under the grammar's masks, so its drafts are the
target's own choices: accepted unless the grammar completes on them).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from carpool import LLM, SamplingParams, StructuredOutputsParams
from tests.engine.test_speculative_decoding import METHODS, SETTINGS, assert_clean, speculative

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "tags": {"type": "array", "maxItems": 6,
                                  "items": {"enum": ["ab", "cd"]}}}}
REGEX = r"(ab|cd){1,12}x[0-9]{2,8}"
CHOICES = ["alpha beta gamma delta", "alpha beta delta gamma", "delta"]
GRAMMARS = {"json": StructuredOutputsParams(json=SCHEMA),
            "regex": StructuredOutputsParams(regex=REGEX),
            "choice": StructuredOutputsParams(choice=CHOICES)}
PROMPTS = ['{"name": "abab", "tags": ["ab", "cd", "ab", "cd"]}\n' * 3,
           "ababcdx1234 ababcdx1234 ababcdx1234 abab",
           "alpha beta gamma delta; alpha beta gamma delta; alpha beta"]
MAX_TOKENS = 64
# each prompt four times under KV pressure: the requests preempt each other
PROMPTS_OF = {"default": PROMPTS, "chunked_preemption": PROMPTS * 4}


def satisfies(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


def greedy(grammar: StructuredOutputsParams, num_prompts: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=grammar)


def run(llm: LLM, prompts: list[str], params_of=greedy) -> dict[str, tuple[list, int]]:
    """Per grammar: each prompt's (token ids, text, finish reason), and the drafts the
    grammar's requests got accepted (the counter's growth over their run);
    `params_of(grammar, number of prompts)`: their sampling parameters."""
    results = {}
    for kind, grammar in GRAMMARS.items():
        before = llm.stats().spec_decode_num_accepted_tokens
        outs = llm.generate(prompts, params_of(grammar, len(prompts)), use_tqdm=False)
        results[kind] = ([(o.outputs[0].token_ids, o.outputs[0].text,
                           o.outputs[0].finish_reason) for o in outs],
                         llm.stats().spec_decode_num_accepted_tokens - before)
    return results


def assert_held_and_speculated(results: dict[str, tuple[list, int]]) -> None:
    """Every output ended on its complete grammar and satisfies it; each grammar's own
    requests had drafts accepted (outputs that repeat their prompts)."""
    for kind, (outputs, accepted) in results.items():
        for tokens, text, finish_reason in outputs:
            assert finish_reason == "stop" and satisfies(kind, text), (kind, text)
            assert 0 < len(tokens) < MAX_TOKENS
        assert accepted > 0, kind


@pytest.fixture(scope="module")
def checkpoint(separated_checkpoint):
    return str(separated_checkpoint("qwen3"))  # the one that loops most


@pytest.fixture(scope="module")
def without_speculation(checkpoint):
    cache = {}

    def get(setting):
        if setting not in cache:
            with LLM(checkpoint, dtype="float32", device="cpu", **SETTINGS[setting]) as plain:
                cache[setting] = run(plain, PROMPTS_OF[setting])
        return cache[setting]
    return get


@pytest.mark.parametrize("setting", ["default", "chunked_preemption"])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_grammar_outputs_equal_no_speculation_and_hold(method, setting, checkpoint,
                                                              without_speculation):
    expected = without_speculation(setting)
    with LLM(checkpoint, dtype="float32", device="cpu",
             speculative_config=speculative(method, checkpoint), **SETTINGS[setting]) as llm:
        got = run(llm, PROMPTS_OF[setting])
        stats = llm.stats()
        assert_clean(llm)
    assert_held_and_speculated(got)
    for kind in GRAMMARS:
        assert got[kind][0] == expected[kind][0], kind
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    if setting == "chunked_preemption":
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("method", METHODS)
def test_sampled_grammar_outputs_hold_and_repeat(method, checkpoint):
    """Seeded samples at temperature 0.8 under each grammar: every output satisfies it, the
    grammar requests' drafts are accepted (n-gram: with the masked p; a draft model: by
    rejection sampling against its masked q), and the same seeds give the same outputs
    again; with n-gram drafts those of a run without speculation (its rows draw a plain
    decode's numbers)."""
    def sampled(llm):
        return run(llm, PROMPTS, lambda grammar, num_prompts: [
            SamplingParams(temperature=0.8, seed=i, max_tokens=MAX_TOKENS,
                           structured_outputs=grammar) for i in range(num_prompts)])
    with LLM(checkpoint, dtype="float32", device="cpu", num_kv_blocks=256) as plain:
        expected = sampled(plain)
    with LLM(checkpoint, dtype="float32", device="cpu", num_kv_blocks=256,
             speculative_config=speculative(method, checkpoint)) as llm:
        got = sampled(llm)
        again = sampled(llm)
        assert_clean(llm)
    assert_held_and_speculated(got)
    for kind in GRAMMARS:
        assert got[kind][0] == again[kind][0], kind
        if method == "ngram":
            assert got[kind][0] == expected[kind][0], kind


def test_a_draft_models_slots_cut_by_the_grammar_are_not_counted_as_drafts(checkpoint,
                                                                          monkeypatch):
    """Issue 61: the draft model stops drafting before a token that completes the grammar,
    so some steps verify fewer drafts than the scheduler planned slots for, or none. The
    spec_decode counters count the drafts the proposer filled in, not the slots."""
    from carpool.runner.draft_proposer import DraftProposer

    counts = {"slots": 0, "draft_tokens": 0, "drafts": 0}
    original = DraftProposer.propose

    def propose(self, scheduler_output, grammar=None):
        drafted = original(self, scheduler_output, grammar)
        planned = {r.request_id: len(r.draft_token_ids) for r in scheduler_output.scheduled
                   if r.draft_token_ids}
        for row in drafted.scheduler_output.scheduled:
            if row.request_id in planned:
                counts["slots"] += planned[row.request_id]
                counts["draft_tokens"] += len(row.draft_token_ids)
                counts["drafts"] += bool(row.draft_token_ids)
        return drafted

    monkeypatch.setattr(DraftProposer, "propose", propose)
    with LLM(checkpoint, dtype="float32", device="cpu", num_kv_blocks=256,
             speculative_config=speculative("draft_model", checkpoint)) as llm:
        results = run(llm, PROMPTS)
        stats = llm.stats()
        assert_clean(llm)
    assert_held_and_speculated(results)
    assert 0 < counts["draft_tokens"] < counts["slots"]  # the grammars cut drafts
    assert stats.spec_decode_num_draft_tokens == counts["draft_tokens"]
    assert stats.spec_decode_num_drafts == counts["drafts"]
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
