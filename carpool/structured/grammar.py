"""A request's structured-output params as llguidance grammar text, checked before it runs.

llguidance takes one grammar format for all kinds: a JSON schema, a regex, a list of
choices and Lark (or llama.cpp GBNF) text all become the same grammar string, which the
compiler then builds against the tokenizer. Checking needs no tokenizer, so the server can
refuse a bad schema with a 400 before the request reaches the engine. The grammar's size is
measured against the server's `GrammarLimits` first (`limits.py`), and the library's error
text is cut to its reason: clients never see its state, the grammar, or a Rust panic's
backtrace with build paths.
"""

from __future__ import annotations

import json

import llguidance

from carpool.sampling_params import GrammarLimits, StructuredOutputsParams
from carpool.structured.limits import check_limits

# What `response_format: {"type": "json_object"}` allows: any JSON object.
ANY_JSON_OBJECT = '{"type": "object"}'
# JSON is written as Python's json.dumps writes it: no free-form whitespace, which small
# models would otherwise fill (newline after newline) until max_tokens. A schema's own
# "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's error text is one line of reason, then its state and the whole grammar (which
# can be megabytes of the client's text), or a panic's backtrace: messages and logs keep the
# reason, this long at most.
MAX_ERROR_CHARS = 300
# Reasons llguidance names without saying what they mean.
_REASONS = {"NoExtensionBias": "no token can continue the output (the grammar may match "
                               "nothing here)"}


def grammar_text(params: StructuredOutputsParams, field: str = "structured_outputs",
                 limits: GrammarLimits | None = None) -> str:
    """llguidance's grammar for `params`; ValueError naming `field` if it is over `limits`
    or cannot be built (the caller's name for the field: `response_format`, ...)."""
    kind = params.kind
    if limits is not None:
        check_limits(params, limits, field)
    try:
        if kind in ("json", "json_object"):
            schema = ANY_JSON_OBJECT if kind == "json_object" else _json_schema(params.json,
                                                                                 field)
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        elif kind == "choice":
            text = llguidance.grammar_from("choice", json.dumps(list(params.choice)))
        else:
            text = llguidance.grammar_from(kind, getattr(params, kind))
    except ValueError as exc:
        raise ValueError(f"{field}: invalid {kind}: {error_reason(str(exc))}") from None
    return text


def check(params: StructuredOutputsParams, field: str = "structured_outputs",
          limits: GrammarLimits | None = None) -> str:
    """The grammar text of `params` once llguidance accepts it; ValueError naming `field`."""
    text = grammar_text(params, field, limits)
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise ValueError(f"{field}: invalid {params.kind}: {error_reason(error)}")
    return text


def error_reason(error: str) -> str:
    """The reason in llguidance's error text, on one line, without its state, grammar or a
    panic's backtrace."""
    reason = error.split("\n<state>", 1)[0].split("\n<backtrace>", 1)[0]
    if reason.startswith("panic:"):  # the library's own assertion, about its limits
        reason = ("the grammar library cannot build it (" + reason.splitlines()[0]
                  .removeprefix("panic:").strip() + "); make it smaller")
    reason = " ".join(reason.split())
    reason = _REASONS.get(reason, reason)
    if len(reason) > MAX_ERROR_CHARS:
        reason = reason[:MAX_ERROR_CHARS - 3] + "..."
    return reason


def _json_schema(text: str, field: str) -> str:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{field}: the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{field}: a JSON schema must be an object, got {type(schema).__name__}")
    return text
