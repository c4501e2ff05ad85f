"""Tool calling through the official `openai` client against a live server (built-in model,
temperature 1.0): forced calls validate against their function's schema, auto calls are read
back by the hermes parser, streamed deltas add up to the same calls, history renders."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.structured.conftest import MODEL

pytestmark = pytest.mark.slow  # a live server (still run in CI)

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "Weather in a city"}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_and_required_tool_choice(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in (named, "required"):
        for seed in range(2):
            out = client.chat.completions.create(
                model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                temperature=1.0, seed=seed, max_tokens=120, parallel_tool_calls=False)
            choice = out.choices[0]
            assert choice.finish_reason == "tool_calls", choice.message
            _check_calls(choice.message.tool_calls)
            if tool_choice is named:
                assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]


def test_streamed_tool_calls_add_up(client):
    for tool_choice in ({"type": "function", "function": {"name": "get_time"}}, "required"):
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(
                model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                temperature=1.0, seed=3, max_tokens=120, stream=True,
                parallel_tool_calls=False):
            delta = chunk.choices[0].delta
            for part in delta.tool_calls or ():
                call = calls.setdefault(part.index, {"id": part.id, "name": "", "arguments": ""})
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and calls
        for call in calls.values():
            assert call["id"]
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_auto_tool_choice_reads_hermes_calls(client):
    call = {"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
            "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER},
            "x-guidance": {"whitespace_flexible": False}}
    grammar = f'start: "I will check.\\n<tool_call>\\n" call "\\n</tool_call>"\n' \
              f"call: %json {json.dumps(call)}"
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto", temperature=1.0,
        max_tokens=120, extra_body={"structured_outputs": {"grammar": grammar}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will check."
    _check_calls(choice.message.tool_calls)
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=5, max_tokens=120,
        stream=True, extra_body={"structured_outputs": {"grammar": grammar}})
    chunks = [c.choices[0] for c in stream]
    content = "".join(c.delta.content or "" for c in chunks)
    parts = [p for c in chunks for p in c.delta.tool_calls or ()]
    assert content == "I will check.\n" and chunks[-1].finish_reason == "tool_calls"
    assert "<tool_call>" not in content and len(parts) == 1
    jsonschema.validate(json.loads(parts[0].function.arguments), WEATHER)


def test_auto_plain_text_stays_content(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                         temperature=1.0, max_tokens=8,
                                         extra_body={"guided_regex": "It is sunny[.]"})
    assert out.choices[0].message.content == "It is sunny."
    assert not out.choices[0].message.tool_calls and out.choices[0].finish_reason == "stop"


def test_history_with_tool_calls_renders(client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    short = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                           tool_choice="none", max_tokens=1)
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                         tool_choice="none", max_tokens=4, temperature=0)
    assert out.usage.prompt_tokens > short.usage.prompt_tokens + 20
    assert isinstance(out.choices[0].message.content, str)
