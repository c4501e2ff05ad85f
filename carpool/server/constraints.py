"""The request fields that constrain output to a grammar, as one `StructuredOutputsParams`.

Three spellings reach the same thing: OpenAI's `response_format` (`text`, `json_object`,
`json_schema`), vLLM's `structured_outputs` object (`json`, `regex`, `choice`, `grammar`,
`json_object`) and vLLM's older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`. A request may use one of them. `check_grammar` checks the grammar off the
event loop, in the app's `GrammarChecker` (its own process, with a time budget), so a bad,
oversized, slow or crashing schema, regex or grammar is a 400 whose message and `param` name
the field the client sent, and never stalls or ends the server.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from carpool.sampling_params import GrammarLimits, SamplingParams, StructuredOutputsParams
from carpool.structured.checker import GrammarChecker

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs_of(body: Any) -> StructuredOutputsParams | None:
    """The one grammar the body asks for, not yet checked; None when it asks for none."""
    found = _constraints(body)
    return found[0][1] if found else None


async def check_grammar(request: Request, body: Any, params: SamplingParams) -> None:
    """Check the grammar of `params` (the body's, or a forced tool call's) in the app's
    checker, on its thread; ValueError naming the body's field."""
    if params.structured_outputs is None:
        return
    field = _field_of(body)
    state = request.app.state
    checker = getattr(state, "grammar_checker", None)
    if checker is None:
        # `serve` sets the flags' limits; an app built without them takes the defaults.
        limits = getattr(state, "grammar_limits", None) or GrammarLimits()
        checker = state.grammar_checker = GrammarChecker(limits)
    await asyncio.get_running_loop().run_in_executor(
        checker.executor, checker.check, params.structured_outputs, field)


def _field_of(body: Any) -> str:
    """The field the body's one grammar came from (`structured_outputs_of` refused more);
    `tools` when none did: a forced tool call's."""
    if body.response_format is not None and body.response_format.get("type") != "text":
        return "response_format"
    if body.structured_outputs is not None:
        return "structured_outputs"
    return next((name for name in GUIDED_FIELDS if getattr(body, name) is not None), "tools")


def _constraints(body: Any) -> list[tuple[str, StructuredOutputsParams]]:
    found: list[tuple[str, StructuredOutputsParams]] = []
    if body.response_format is not None:
        params = _from_response_format(body.response_format)
        if params is not None:
            found.append(("response_format", params))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _from_structured(body.structured_outputs)))
    for name, key in GUIDED_FIELDS.items():
        value = getattr(body, name)
        if value is not None:
            found.append((name, _build(name, **{key: value})))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ValueError(f"{found[1][0]}: only one of response_format, structured_outputs and "
                         f"guided_* may constrain the output, got {names}")
    return found


def _from_response_format(response_format: dict) -> StructuredOutputsParams | None:
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _build("response_format", json_object=True)
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"), dict):
            raise ValueError("response_format: json_schema.schema must be a JSON schema object")
        return _build("response_format", json=json_schema["schema"])
    raise ValueError(f"response_format: type must be 'text', 'json_object' or 'json_schema', "
                     f"got {kind!r}")


def _from_structured(structured: dict) -> StructuredOutputsParams:
    unknown = sorted(set(structured) - set(STRUCTURED_KEYS))
    if unknown:
        raise ValueError(f"structured_outputs: unsupported key(s) {', '.join(unknown)} "
                         f"(supported: {', '.join(STRUCTURED_KEYS)})")
    given = {k: v for k, v in structured.items() if v is not None and v is not False}
    return _build("structured_outputs", **given)


def _build(field: str, **kwargs) -> StructuredOutputsParams:
    """StructuredOutputsParams(**kwargs), its ValueError reworded to name the client's field."""
    try:
        return StructuredOutputsParams(**kwargs)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        if message.startswith("structured_outputs"):
            raise ValueError(field + message.removeprefix("structured_outputs")) from None
        raise ValueError(f"{field}: {message}") from None
