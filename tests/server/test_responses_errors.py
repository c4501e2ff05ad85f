"""`POST /v1/responses`: a malformed input item, content part or `text.format` is a 400 in
OpenAI's error body whose message names where it is (`input[0].content`), never a 500."""

from __future__ import annotations

import pytest

from tests.server.live import MODEL_NAME
from tests.server.test_errors import assert_error

pytestmark = pytest.mark.slow  # a live server (still run in CI)

RESPONSE = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 4}
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}


def output_item(output) -> dict:
    return {"type": "function_call_output", "call_id": "call_1", "output": output}


def user(content) -> dict:
    return {"role": "user", "content": content}


MALFORMED = [
    ({"input": [user(5)]}, "input", "input[0].content"),
    ({"input": [user([{"type": "input_text", "text": 5}])]}, "input", "input[0].content[0].text"),
    ({"input": [user("hi"), CALL, output_item(5)]}, "input", "input[2].output"),
    ({"text": {"format": "json"}}, "text", "text.format"),
    ({"input": [user([{"type": "input_image", "image_url": "x"}])]}, "input",
     "input[0].content[0].type"),
    ({"input": [user([5])]}, "input", "input[0].content[0]"),
    ({"input": [{"content": "hi"}]}, "input", "input[0].role"),
    ({"input": [{"role": "tool", "content": "hi"}]}, "input", "input[0].role"),
    ({"input": [5]}, "input", "input[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "input[0]"),
    ({"input": [output_item([{"type": "input_file", "file_id": "f"}])]}, "input",
     "input[0].output[0].type"),
    ({"input": [{**output_item("x"), "call_id": None}]}, "input", "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c"}]}, "input", "input[0].name"),
    ({"input": [{**CALL, "arguments": {"x": 1}}]}, "input", "input[0].arguments"),
    ({"text": {"format": {"type": "xml"}}}, "text", "text.format"),
    ({"text": {"format": {}}}, "text", "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "schema": "object"}}}, "text",
     "text.format.schema"),
    ({"text": "json"}, "text", "text"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools",
     "tools[0].parameters"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tools[0].type"),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice", "tool_choice.name"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"instructions": 5}, "instructions", "instructions"),
    ({"instructions": ["be brief"]}, "instructions", "instructions"),
]


@pytest.mark.parametrize("fields,param,where", MALFORMED,
                         ids=[str(fields) for fields, _, _ in MALFORMED])
def test_malformed_field_is_400_naming_where(server, fields, param, where):
    with server.http() as http:
        response = http.post("/v1/responses", json={**RESPONSE, **fields})
    error = assert_error(response, 400, param)
    assert error["message"].startswith(f"{where}: "), error["message"]


HISTORY = [user([{"type": "input_text", "text": "Weather?"}]), CALL,
           output_item([{"type": "input_text", "text": "12 degrees"}]),
           {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
            "content": [{"type": "output_text", "text": "12.", "annotations": []}]}]


@pytest.mark.parametrize("fields", [
    {"text": {"format": {"type": "json_object"}}, "tool_choice": "none"},
    {"tool_choice": {"type": "function", "name": "f"}},
])
def test_well_formed_items_are_served_and_fields_echoed(server, fields):
    with server.http() as http:
        response = http.post("/v1/responses", json={**RESPONSE, "input": HISTORY,
                                                     "tools": [TOOL], **fields})
    assert response.status_code == 200, response.text
    echo = response.json()
    assert echo["tools"] == [TOOL]
    assert echo["text"] == fields.get("text", {"format": {"type": "text"}})
    assert echo["tool_choice"] == fields["tool_choice"]
