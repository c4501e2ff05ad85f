"""`/v1/responses` bodies without a server: malformed items are pydantic errors that the
server's 400 names by location (`input[0].content`); well-formed ones become chat requests."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from carpool.server.errors import validation_error
from carpool.server.responses_protocol import ResponsesRequest


def error_of(body: dict):
    with pytest.raises(ValidationError) as info:
        ResponsesRequest(**body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    return validation_error(RequestValidationError(errors))


@pytest.mark.parametrize("body,param,where", [
    ({"input": [{"role": "user", "content": 5}]}, "input", "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input",
     "input[0].content[0].text"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input",
     "input[0].output"),
    ({"input": "hi", "text": {"format": "json"}}, "text", "text.format"),
    ({"input": [{"type": "input_image"}]}, "input", "input[0]"),
])
def test_malformed_body_is_named_by_location(body, param, where):
    error = error_of(body)
    assert error.status_code == 400 and error.param == param
    assert error.message.startswith(f"{where}: "), error.message


def test_items_become_chat_messages():
    body = ResponsesRequest(instructions="Be brief.", text={"format": {
        "type": "json_schema", "name": "w", "schema": {"type": "object"}}}, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                     {"type": "input_text", "text": "?"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "12"}]}])
    chat = body.to_chat()
    assert [(m.role, m.text()) for m in chat.messages] == [
        ("system", "Be brief."), ("user", "Weather?"), ("assistant", ""), ("tool", "12")]
    assert [call.id for call in chat.messages[2].tool_calls] == ["c1", "c2"]
    assert chat.response_format == {"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "object"}, "strict": None}}
