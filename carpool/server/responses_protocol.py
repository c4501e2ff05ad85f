"""The body of OpenAI's `POST /v1/responses`, and the chat request it amounts to.

The stateless part of the Responses API is a chat completion in other clothes: `input`
items become messages (function calls and their outputs included), `instructions` a system
message, function tools and `text.format` the chat fields of the same meaning. What needs
state or features carpool lacks (`store`, `previous_response_id`, `background`, built-in
tools, images) is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt

from carpool.server.protocol import ChatCompletionRequest, StreamOptions, Text


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    input: Text | list[dict]
    instructions: Text | None = None
    tools: list[dict] | None = None
    tool_choice: Text | dict | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stream: bool = False
    text: dict | None = None
    store: bool | None = None
    background: bool | None = None
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
        return ChatCompletionRequest(
            model=self.model, messages=messages, max_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, stream=self.stream,
            stream_options=StreamOptions(include_usage=True) if self.stream else None,
            tools=_tools(self.tools), tool_choice=_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=_response_format(self.text), user=self.user)

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


def _messages(input_: str | list[dict]) -> list[dict]:
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    if not input_:
        raise ValueError("input must not be empty")
    messages: list[dict] = []
    for i, item in enumerate(input_):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(i, item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _text(i, output)})
        else:
            raise ValueError(f"input[{i}]: items of type {kind!r} are not supported "
                             "(message, function_call, function_call_output)")
    return messages


def _text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content or ():
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text",
                                                                  "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"input[{index}]: content parts of type {kind!r} are not "
                             "supported (text only)")
        parts.append(part.get("text", ""))
    return "".join(parts)


def _tools(tools: list[dict] | None) -> list[dict] | None:
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ValueError(f"tools[{i}]: only function tools are supported, "
                             f"got {tool.get('type')!r}")
        converted.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters") if k in tool}})
    return converted


def _tool_choice(tool_choice: str | dict | None) -> str | dict | None:
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        return {"type": "function", "function": {"name": tool_choice.get("name")}}
    return tool_choice


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") in ("text", "json_object"):
        return fmt
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
    raise ValueError(f"text: format type must be text, json_object or json_schema, "
                     f"got {fmt.get('type')!r}")
