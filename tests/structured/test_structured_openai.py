"""Structured outputs through the official `openai` client against a live server.

The built-in model, sampled at temperature 1.0: every output that finishes with `stop`
must parse and validate (pydantic, `jsonschema`, `re`), which only the constraint makes so.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pydantic
import pytest

from tests.structured.conftest import MODEL

pytestmark = pytest.mark.slow  # a live server (still run in CI)

MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]


class City(pydantic.BaseModel):
    # Every field bounded, so a document ends within max_tokens whatever the sampled stream
    # (unbounded, CUDA's seeded stream once sampled digits past max_tokens: 'length').
    name: str = pydantic.Field(max_length=16)
    population: int = pydantic.Field(ge=0, le=10**9)
    coastal: bool


def test_parse_with_a_pydantic_model(client):
    for seed in range(3):
        out = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=City,
                                            temperature=1.0, seed=seed, max_tokens=80)
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, City)


def test_json_schema_streamed_equals_a_valid_document(client):
    schema = City.model_json_schema()
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "city", "schema": schema, "strict": True}}
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=response_format, temperature=1.0,
        seed=7, max_tokens=80, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_json_object_choice_and_regex(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0,
                                         response_format={"type": "json_object"}, max_tokens=60)
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:
        assert out.choices[0].message.content.startswith("{")
    for extra, check in [
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}},
         lambda t: t in ("red", "green", "blue")),
        ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ({"guided_regex": r"\d{2}:\d{2}"}, lambda t: re.fullmatch(r"\d{2}:\d{2}", t)),
        ({"structured_outputs": {"regex": r"[A-Z][a-z]{2,5}"}},
         lambda t: re.fullmatch(r"[A-Z][a-z]{2,5}", t)),
    ]:
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0,
                                             max_tokens=20, extra_body=extra)
        assert out.choices[0].finish_reason == "stop" and check(out.choices[0].message.content)


def test_completions_route_takes_the_same_fields(client):
    out = client.completions.create(model=MODEL, prompt="The answer is", temperature=1.0,
                                    max_tokens=10, n=3, extra_body={"guided_regex": "(yes|no)!"})
    assert [c.text for c in out.choices if re.fullmatch("(yes|no)!", c.text)] == [
        c.text for c in out.choices]
    assert all(c.finish_reason == "stop" for c in out.choices)


def test_max_tokens_first_is_length(client):
    # '{"name": ...' cannot be complete in 2 tokens ('{}' could, under json_object)
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "city", "schema": City.model_json_schema()}}
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0,
                                         max_tokens=2, response_format=response_format)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 2


def test_a_grammar_failing_mid_generation_is_a_400_or_an_error_event(client):
    import openai
    many = [f"option number {i}" for i in range(2010)]  # outgrows the parser on the way
    with pytest.raises(openai.BadRequestError, match="max is 2000") as failed:
        client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20,
                                  extra_body={"guided_choice": many})
    assert failed.value.code == "grammar_error" and "option number 2009" not in str(failed.value)
    with pytest.raises(openai.BadRequestError, match="no token can continue"):  # matches nothing
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                       extra_body={"guided_regex": r"[^\s\S]"})
    looping = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}
    with pytest.raises(openai.BadRequestError, match="grammar failed during generation"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                       tools=[looping], tool_choice="required")

    chunks = []
    with pytest.raises(openai.APIError, match="max is 2000"):  # the stream's error event
        for chunk in client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=20, stream=True,
                extra_body={"guided_choice": many}):
            chunks.append(chunk)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "error"
