"""The body of OpenAI's `POST /v1/responses`, and the chat request it amounts to.

The stateless part of the Responses API is a chat completion in other clothes: `input`
items become messages (function calls and their outputs included), `instructions` a system
message, function tools and `text.format` the chat fields of the same meaning. What needs
state or features carpool lacks (`store`, `previous_response_id`, `background`, built-in
tools, images) is a 400 naming the field. Items, content parts and `text.format` are typed
models, so a malformed one is a 400 naming where it is (`input[0].content`), as OpenAI's is.
"""

from __future__ import annotations

import operator
from functools import reduce
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictFloat, StrictInt, Tag

from carpool.server.protocol import ChatCompletionRequest, StreamOptions, StrictBool, Text


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")  # id, status, annotations, ... are not read


class InputTextPart(_Item):
    """A content part; images and files are not supported."""

    type: Literal["input_text", "output_text", "text"]
    text: Text


Content = Text | list[InputTextPart]


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: Text
    output: Content


class TextFormat(_Item):
    type: Literal["text"]


class JsonObjectFormat(_Item):
    type: Literal["json_object"]


class JsonSchemaFormat(_Item):
    type: Literal["json_schema"]
    name: Text | None = None  # OpenAI requires one; chat's response_format does not
    schema_: dict = Field(alias="schema")
    description: Text | None = None
    strict: StrictBool | None = None


def _tagged(default: str | None, *models: type[_Item]) -> Any:
    """The union of `models` chosen by the `type` field (`default` when absent), so a bad item
    is reported by its own model alone; the tag is the class name, which errors.py leaves out
    of the location it reports."""
    tags = {model.model_fields["type"].annotation.__args__[0]: model.__name__ for model in models}

    def tag(value: Any) -> str | None:  # a dict from JSON, or a model built in Python
        kind = value.get("type", default) if isinstance(value, dict) else getattr(
            value, "type", None)
        return tags.get(kind) if isinstance(kind, str) else None

    members = reduce(operator.or_, (Annotated[model, Tag(model.__name__)] for model in models))
    message = f"must be an object whose type is one of: {', '.join(tags)}"
    return Annotated[members, Discriminator(
        tag, custom_error_type="invalid_type", custom_error_message=message)]


InputItem = _tagged("message", MessageItem, FunctionCallItem, FunctionCallOutputItem)
Format = _tagged(None, TextFormat, JsonObjectFormat, JsonSchemaFormat)


class TextConfig(_Item):
    format: Format | None = None


class FunctionTool(_Item):
    """A function tool; built-in tools (web search, files, ...) are not supported."""

    type: Literal["function"]
    name: Text
    description: Text | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class FunctionChoice(_Item):
    type: Literal["function"]
    name: Text


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    input: Text | list[InputItem]
    instructions: Text | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool = True
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stream: StrictBool = False
    text: TextConfig | None = None
    store: StrictBool | None = None
    background: StrictBool | None = None
    previous_response_id: Text | None = None
    conversation: Any = None
    metadata: dict | None = None
    user: Text | None = None

    def to_chat(self) -> ChatCompletionRequest:
        """The equivalent chat request; ValueError naming the field for what is unsupported."""
        if self.store:
            raise ValueError("store: responses are not stored (this server is stateless); "
                             "send store: false")
        for name in ("background", "previous_response_id", "conversation"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported (this server is stateless)")
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += _messages(self.input)
        text_format = self.text.format if self.text else None
        return ChatCompletionRequest(
            model=self.model, messages=messages, max_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, stream=self.stream,
            stream_options=StreamOptions(include_usage=True) if self.stream else None,
            tools=_tools(self.tools), tool_choice=_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=_response_format(text_format), user=self.user)

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


def _messages(input_: str | list[MessageItem | FunctionCallItem | FunctionCallOutputItem]
              ) -> list[dict]:
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    if not input_:
        raise ValueError("input must not be empty")
    messages: list[dict] = []
    for item in input_:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output)})
    return messages


def _text(content: str | list[InputTextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _tools(tools: list[FunctionTool] | None) -> list[dict] | None:
    if tools is None:
        return None
    return [{"type": "function", "function": tool.model_dump(
        include={"name", "description", "parameters"}, exclude_none=True)} for tool in tools]


def _tool_choice(tool_choice: str | FunctionChoice | None) -> str | dict | None:
    if isinstance(tool_choice, FunctionChoice):
        return {"type": "function", "function": {"name": tool_choice.name}}
    return tool_choice


def _response_format(fmt: TextFormat | JsonObjectFormat | JsonSchemaFormat | None
                     ) -> dict | None:
    if isinstance(fmt, JsonSchemaFormat):
        return {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
    return None if fmt is None else {"type": fmt.type}
