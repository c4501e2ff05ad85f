"""Grammars bounded before llguidance sees them, checked where a crash costs one request, and
compiled off the engine's step thread (hardening issue 64, items 1 and 2).

The grammars are the issue's: a chain of 3,000 Lark rules (which overflows llguidance's
stack: a SIGSEGV), a 640 KB GBNF alternation and 100,000 choices (seconds of Rust work).
"""

from __future__ import annotations

import json
import threading

import pytest

from carpool import LLM, SamplingParams, StructuredOutputsParams
from carpool.sampling_params import GrammarLimits
from carpool.structured.checker import GrammarChecker
from carpool.structured.compiler import GrammarCompiler
from carpool.structured.grammar import error_reason
from carpool.structured.limits import check_limits

UNBOUNDED = GrammarLimits(max_bytes=10**9, max_rules=10**9, max_depth=10**9,
                          max_alternatives=10**9)


def rule_chain(n: int) -> str:
    """`start: r0`, `rN: rN+1 "x"`, `rn: "y"`: n + 2 rules, each one deeper than the last."""
    return "\n".join(["start: r0", *(f'r{i}: r{i + 1} "x"' for i in range(n)), f'r{n}: "y"'])


def gbnf_alternation(n: int) -> str:
    return "root ::= " + " | ".join(f'"word{i}"' for i in range(n))


def ref_chain(n: int) -> str:
    defs = {f"a{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/a{i + 1}"}}}
            for i in range(n)}
    return json.dumps({"$ref": "#/$defs/a0", "$defs": {**defs, f"a{n}": {"type": "string"}}})


@pytest.mark.parametrize("params, field, words", [
    (StructuredOutputsParams(grammar=rule_chain(3000)), "structured_outputs",
     ("3002 rules", "limit of 500", "--max-grammar-rules")),
    (StructuredOutputsParams(grammar=gbnf_alternation(60_000)), "guided_grammar",
     ("bytes", "limit of 131072", "--max-grammar-bytes")),
    (StructuredOutputsParams(choice=[f"choice {i}" for i in range(100_000)]), "guided_choice",
     ("100000 choices", "limit of 2000", "--max-grammar-alternatives")),
    (StructuredOutputsParams(json=ref_chain(1000)), "response_format",
     ("1001 $refs", "--max-grammar-rules")),
    (StructuredOutputsParams(json='{"type": "array", "items": ' * 70 + "{}" + "}" * 70),
     "response_format", ("levels of nesting", "--max-grammar-depth")),
    (StructuredOutputsParams(regex="(" * 65 + "a" + ")" * 65), "guided_regex",
     ("65 levels of nesting", "--max-grammar-depth")),
    (StructuredOutputsParams(regex="|".join(["a"] * 2_001)), "guided_regex",
     ("2001 alternatives",)),
])
def test_over_a_limit_is_a_value_error_naming_field_limit_and_flag(params, field, words):
    with pytest.raises(ValueError) as raised:
        check_limits(params, GrammarLimits(), field)
    message = str(raised.value)
    assert message.startswith(f"{field}: ")
    for word in words:
        assert word in message, message


def test_real_grammars_at_the_limits_pass():
    limits = GrammarLimits()
    json_gbnf = r'''root ::= object
value ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [1-9] [0-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}'''
    for params in (StructuredOutputsParams(grammar=json_gbnf),
                   StructuredOutputsParams(grammar=rule_chain(498)),
                   StructuredOutputsParams(choice=[f"c{i}" for i in range(2_000)]),
                   StructuredOutputsParams(json=ref_chain(499)),
                   StructuredOutputsParams(regex=r"[(]{3}\(\)[0-9]+|[a-z]+")):
        check_limits(params, limits)


def test_a_panic_and_its_backtrace_never_reach_the_message():
    # llguidance's text when 100,000 choices outgrow its symbol table (as it gave it)
    panic = ("panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n"
             "<backtrace>\n   0: <unknown>\n  16: type_call\n             at /tmp/python-build."
             "20260509073455.222/Python-3.11.7/Objects/typeobject.c:1091:11\n")
    reason = error_reason(panic)
    assert "grammar.symbols.len() < u16::MAX" in reason and "make it smaller" in reason
    assert "backtrace" not in reason and "/tmp/" not in reason and "\n" not in reason


def test_a_grammar_that_crashes_the_checker_costs_one_check():
    checker = GrammarChecker(UNBOUNDED)  # no limits: llguidance itself overflows its stack
    try:
        with pytest.raises(ValueError, match="structured_outputs: the grammar crashed the "
                                             "grammar library"):
            checker.check(StructuredOutputsParams(grammar=rule_chain(3000)))
        assert checker.num_restarts == 1
        checker.check(StructuredOutputsParams(grammar=rule_chain(100)))  # a new process
        with pytest.raises(ValueError, match="guided_regex: invalid regex"):
            checker.check(StructuredOutputsParams(regex="(a"), "guided_regex")
    finally:
        checker.close()


def test_a_check_past_its_time_budget_is_killed_and_its_answer_cached():
    checker = GrammarChecker(GrammarLimits(max_bytes=10**9, max_alternatives=10**9,
                                           check_timeout=0.5))
    slow = StructuredOutputsParams(choice=[f"choice number {i}" for i in range(100_000)])
    try:
        for _ in range(2):  # the second answer comes from the cache: the same 400
            with pytest.raises(ValueError, match="guided_choice: the choice list took more "
                                                 r"than 0.5 s to check \(--grammar-check-"):
                checker.check(slow, "guided_choice")
        assert checker.num_asked == 1 and checker.num_restarts == 1
        good = StructuredOutputsParams(regex="[a-z]+")
        checker.check(good)
        checker.check(good)
        assert checker.num_asked == 2
    finally:
        checker.close()


def test_the_engine_refuses_an_over_limit_grammar_and_the_flag_reaches_it():
    llm = LLM(max_model_len=128, num_kv_blocks=16, max_grammar_rules=50)
    assert llm.engine.config.grammar_limits.max_rules == 50
    params = SamplingParams(structured_outputs=StructuredOutputsParams(grammar=rule_chain(60)))
    with pytest.raises(ValueError, match="structured_outputs: the grammar has 62 rules, more "
                                         "than this server's limit of 50"):
        llm.generate("A", params, use_tqdm=False)


def test_a_compile_never_holds_up_the_step_loop(monkeypatch):
    """While one request's grammar compiles (held here until the other has finished), the
    engine keeps stepping the other; then the constrained one runs under its grammar."""
    llm = LLM(max_model_len=128, num_kv_blocks=32)
    engine = llm.engine
    release = threading.Event()
    real = GrammarCompiler.matcher

    def held(self, params, field="structured_outputs"):
        release.wait(60)
        return real(self, params, field)

    monkeypatch.setattr(GrammarCompiler, "matcher", held)
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    constrained = SamplingParams(temperature=1.0, seed=0, max_tokens=8,
                                 structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    engine.add_request("constrained", "A", constrained)  # returns at once: compiling
    engine.add_request("free", "A", free)
    finished = {}
    while "free" not in finished:
        for out in engine.step():
            if out.finish_reason is not None:
                finished[out.request_id] = out
    assert not release.is_set() and "constrained" not in finished
    assert finished["free"].num_output_tokens == 8
    release.set()
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "constrained":
                text += out.new_text
                finished[out.request_id] = out
    assert finished["constrained"].finish_reason == "stop" and text in ("yes", "no")
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_request_aborted_while_its_grammar_compiles_ends_cleanly(monkeypatch):
    llm = LLM(max_model_len=128, num_kv_blocks=16)
    engine = llm.engine
    release = threading.Event()
    real = GrammarCompiler.matcher
    monkeypatch.setattr(GrammarCompiler, "matcher",
                        lambda self, params, field="structured_outputs":
                        (release.wait(60), real(self, params, field))[1])
    params = SamplingParams(max_tokens=4,
                            structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    engine.add_request("r", "A", params)
    engine.abort_request("r")
    release.set()
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.finish_reason for o in outs] == ["abort"]
    stats = llm.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
