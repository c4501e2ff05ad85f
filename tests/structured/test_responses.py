"""`POST /v1/responses` (stateless) through the official `openai` client: text, a function
tool (forced, so the call validates at temperature 1.0), structured text, streaming events,
a conversation carrying a call and its output, and 400s for what is not supported."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.structured.conftest import MODEL

pytestmark = pytest.mark.slow  # a live server (still run in CI)

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12}}}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": WEATHER, "strict": True}


def test_text_response(client):
    out = client.responses.create(model=MODEL, input="Write a haiku.", max_output_tokens=6,
                                  temperature=1.0, store=False)
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.status in ("completed", "incomplete") and isinstance(out.output_text, str)
    assert out.usage.output_tokens <= 6 and out.usage.input_tokens > 0
    if out.status == "incomplete":
        assert out.incomplete_details.reason == "max_output_tokens"


def test_function_tool_call_and_its_output(client):
    out = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[TOOL],
                                  tool_choice="required", parallel_tool_calls=False,
                                  temperature=1.0, max_output_tokens=60)
    calls = [item for item in out.output if item.type == "function_call"]
    assert out.status == "completed" and len(calls) == 1
    assert calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    follow = client.responses.create(
        model=MODEL, tools=[TOOL], tool_choice="none", max_output_tokens=4, temperature=0,
        input=[{"role": "user", "content": "Weather in Oslo?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "12 degrees"}])
    assert follow.usage.input_tokens > out.usage.input_tokens
    assert all(item.type == "message" for item in follow.output)


def test_structured_text_format(client):
    schema = {"type": "object", "required": ["ok"], "additionalProperties": False,
              "properties": {"ok": {"type": "boolean"}}}
    out = client.responses.create(model=MODEL, input="Answer as JSON.", temperature=1.0,
                                  max_output_tokens=20, text={"format": {
                                      "type": "json_schema", "name": "answer", "schema": schema,
                                      "strict": True}})
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), schema)


def test_streaming_events(client):
    named = {"type": "function", "name": "get_weather"}
    events = list(client.responses.create(model=MODEL, input="Weather?", tools=[TOOL],
                                          tool_choice=named, temperature=1.0,
                                          max_output_tokens=60, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == arguments
    jsonschema.validate(json.loads(arguments), WEATHER)
    final = events[-1].response
    assert [item.type for item in final.output] == ["function_call"]
    assert final.output[0].arguments == arguments

    text_events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=5,
                                               temperature=1.0, stream=True))
    text = "".join(e.delta for e in text_events if e.type == "response.output_text.delta")
    assert text_events[-1].response.output_text == text


@pytest.mark.parametrize("extra, field", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
])
def test_unsupported_is_400(client, extra, field):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{"model": MODEL, "input": "hi", **extra})
    assert info.value.body["param"] == field or field in info.value.body["message"]
