"""A request's structured-output params as llguidance grammar text, checked before it runs.

llguidance takes one grammar format for all kinds: a JSON schema, a regex, a list of
choices and Lark (or llama.cpp GBNF) text all become the same grammar string, which the
compiler then builds against the tokenizer. Checking needs no tokenizer, so the server can
refuse a bad schema with a 400 before the request reaches the engine.
"""

from __future__ import annotations

import json

import llguidance

from carpool.sampling_params import StructuredOutputsParams

# What `response_format: {"type": "json_object"}` allows: any JSON object.
ANY_JSON_OBJECT = '{"type": "object"}'
# JSON is written as Python's json.dumps writes it: no free-form whitespace, which small
# models would otherwise fill (newline after newline) until max_tokens. A schema's own
# "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(params: StructuredOutputsParams, field: str = "structured_outputs") -> str:
    """llguidance's grammar for `params`; ValueError naming `field` if it cannot be built
    (the caller's name for the field: `response_format`, `guided_json`, ...)."""
    kind = params.kind
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
        raise ValueError(f"{field}: invalid {kind}: {exc}") from None
    return text


def check(params: StructuredOutputsParams, field: str = "structured_outputs") -> str:
    """The grammar text of `params` once llguidance accepts it; ValueError naming `field`."""
    text = grammar_text(params, field)
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise ValueError(f"{field}: invalid {params.kind}: {error.strip()}")
    return text


def _json_schema(text: str, field: str) -> str:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{field}: the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{field}: a JSON schema must be an object, got {type(schema).__name__}")
    return text
