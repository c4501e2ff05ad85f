"""Grammar-constrained decoding through the offline `LLM` on the built-in model.

Sampled at temperature 1.0, so validity comes from the constraint, not from a likely
greedy path; the references are `jsonschema`, `re` and the choice list themselves.
"""

from __future__ import annotations

import json
import pickle
import re

import jsonschema
import pytest

from carpool import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
REGEX = r"[0-9]{3}-[a-z]{2}"


@pytest.fixture(scope="module")
def llm():
    # More alternatives than the default limit: the 2,010-choice grammar below must reach the
    # parser, whose row limit then fails it during generation.
    return LLM(max_model_len=256, num_kv_blocks=64, max_grammar_alternatives=10_000)


def _sampled(llm, structured, n=4, max_tokens=48, **kwargs):
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                             structured_outputs=structured, **kwargs) for i in range(n)]
    return [o.outputs[0] for o in llm.generate(["A person:"] * n, params, use_tqdm=False)]


def test_json_schema_regex_choice_and_grammar_hold(llm):
    for out in _sampled(llm, StructuredOutputsParams(json=SCHEMA)):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    for out in _sampled(llm, StructuredOutputsParams(regex=REGEX)):
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text
    for out in _sampled(llm, StructuredOutputsParams(choice=["yes", "no", "maybe"])):
        assert out.finish_reason == "stop" and out.text in ("yes", "no", "maybe")
    grammar = 'start: "SELECT " COL " FROM t"\nCOL: "a" | "b" | "c"'
    for out in _sampled(llm, StructuredOutputsParams(grammar=grammar)):
        assert out.finish_reason == "stop" and re.fullmatch("SELECT [abc] FROM t", out.text)
    for out in _sampled(llm, StructuredOutputsParams(json_object=True), n=2, max_tokens=64):
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)


def test_max_tokens_first_finishes_with_length(llm):
    (out,) = _sampled(llm, StructuredOutputsParams(json=SCHEMA), n=1, max_tokens=3)
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith("{")
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


def test_unconstrained_rows_are_untouched_in_a_mixed_batch(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate("def f(x):", plain, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(["def f(x):", "A person:"], [plain, SamplingParams(
        temperature=1.0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=REGEX))],
        use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    assert re.fullmatch(REGEX, mixed[1].outputs[0].text)


@pytest.mark.parametrize("structured, field", [
    (StructuredOutputsParams(regex="[a-"), "regex"),
    (StructuredOutputsParams(json={"type": "nonsense"}), "json"),
    (StructuredOutputsParams(json="{not json"), "json"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar"),
])
def test_invalid_grammar_is_a_value_error_naming_the_field(llm, structured, field):
    with pytest.raises(ValueError, match=rf"^structured_outputs: invalid {field}|"
                                         r"^structured_outputs: the JSON schema"):
        llm.generate("x", SamplingParams(structured_outputs=structured), use_tqdm=False)
    assert llm.stats().num_running == 0 and llm.stats().num_waiting == 0


def test_params_need_exactly_one_field_and_pickle():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a"))
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    assert pickle.loads(pickle.dumps(params)) == params
    assert isinstance(params.structured_outputs.json, str)


def test_grammar_completed_on_the_last_allowed_token_is_stop(llm):
    structured = StructuredOutputsParams(regex="[a-z]{3,9}!")
    (free,) = _sampled(llm, structured, n=1, max_tokens=20)
    assert free.finish_reason == "stop"
    (exact,) = _sampled(llm, structured, n=1, max_tokens=len(free.token_ids))
    assert exact.token_ids == free.token_ids and exact.finish_reason == "stop"


def test_constrained_requests_survive_preemption():
    small = LLM(max_model_len=256, num_kv_blocks=10, max_num_seqs=8)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA))
              for i in range(8)]
    outs = small.generate(["A person:"] * 8, params, use_tqdm=False)
    assert small.stats().num_preemptions > 0
    for out in outs:
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
        else:
            assert len(out.outputs[0].token_ids) == 40


@pytest.mark.parametrize("structured, reason", [
    (StructuredOutputsParams(regex=r"[^\s\S]"), "no token can continue"),  # matches nothing
    (StructuredOutputsParams(json={"$ref": "#"}), "no token can continue"),
    # compiles, then outgrows the parser's row limit on the first token
    (StructuredOutputsParams(choice=[f"option number {i}" for i in range(2010)]),
     "max is 2000"),
])
def test_a_grammar_failing_mid_generation_is_an_error_not_stop(llm, caplog, structured, reason):
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=40,
                            structured_outputs=structured)
    with pytest.raises(RuntimeError, match=f"grammar failed during generation: .*{reason}"):
        llm.generate("A person:", params, use_tqdm=False)
    stats = llm.stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
    logged = [r.getMessage() for r in caplog.records if r.name == "carpool.structured.manager"]
    assert len(logged) == 1 and reason in logged[0]
    assert "option number 2009" not in logged[0] and "<grammar>" not in logged[0]

    engine = llm.engine  # the engine's own output: `error` with the reason, never `stop`
    engine.add_request("failing", "A person:", params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finish_reason == "error" and outs[-1].error_code == "grammar_error"
    assert reason in outs[-1].error


def test_grammar_cache_memory_reaches_the_compiler():
    keep_none = LLM(max_model_len=256, num_kv_blocks=16, grammar_cache_memory=0)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    for _ in range(2):
        out = keep_none.generate("A person:", params, use_tqdm=False)[0].outputs[0]
        assert re.fullmatch(REGEX, out.text)
    compiler = keep_none.engine._structured._compiler
    assert compiler.cache_memory == 0 and compiler.num_cached == 0
