"""POST /v1/responses: OpenAI's Responses API, stateless (no store, no background).

The body becomes a chat request (`responses_protocol`), which runs exactly as
`/v1/chat/completions` does: same template, tools, constraints and engine path. The
answer is reshaped: `output` holds a `message` item (its `output_text`) and one
`function_call` item per tool call; a stream sends OpenAI's typed events
(`response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ... `response.completed`), each with a
`sequence_number`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ValidationError

from carpool.outputs import StepOutput
from carpool.server.chat import ChatContext, chat_message, prepare_chat
from carpool.server.errors import bad_request
from carpool.server.generation import Choice, Usage, serve_generation
from carpool.server.protocol import REQUEST_FIELDS
from carpool.server.responses_protocol import ResponsesRequest

router = APIRouter()
logger = logging.getLogger("carpool.server")

RESPONSE_FIELDS = frozenset(ResponsesRequest.model_fields) | REQUEST_FIELDS


@dataclass(frozen=True)
class _Context:
    id: str
    created: int
    chat: ChatContext
    body: ResponsesRequest

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 finish_reason: str | None = None) -> dict:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        error = ({"code": "server_error", "message": "the engine failed on this request"}
                 if status == "failed" else None)
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "model": self.chat.model, "output": output, "usage": usage,
                "error": error, "incomplete_details": incomplete,
                "instructions": body.instructions, "metadata": body.metadata or {},
                "max_output_tokens": body.max_output_tokens,
                "parallel_tool_calls": body.parallel_tool_calls,
                "temperature": body.temperature, "top_p": body.top_p,
                "tool_choice": _dump(body.tool_choice) or "auto",
                "tools": [_dump(tool) for tool in body.tools or ()],
                "text": _text_config(body), "store": False,
                "background": False, "previous_response_id": None}


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    try:
        chat = body.to_chat()
    except (ValueError, ValidationError) as exc:
        raise bad_request(_first_error(exc), RESPONSE_FIELDS) from None
    if body.ignored_fields:
        logger.warning("The following fields were present in the request but ignored: %s",
                       ", ".join(body.ignored_fields))
    settings = request.app.state.settings

    def prepare(info, params) -> tuple[_Context, list]:
        chat_ctx, prompts = prepare_chat(chat, info, params, settings)
        return _Context(f"resp_{uuid.uuid4().hex}", int(time.time()), chat_ctx, body), prompts

    return await serve_generation(request, chat, prepare, _events, _whole, shape_usage=_usage)


def _text_config(body: ResponsesRequest) -> dict:
    if body.text is None or body.text.format is None:
        return {"format": {"type": "text"}}
    return _dump(body.text)


def _dump(value: Any) -> Any:
    """A request's model as the JSON the client sent (its fields this server reads)."""
    return value.model_dump(by_alias=True, exclude_none=True) if isinstance(
        value, BaseModel) else value


def _first_error(exc: Exception) -> Exception:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return ValueError(f"input: {where}: {first.get('msg')}")
    return exc


def _usage(usage: dict) -> dict:
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens":
                                     usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _status(finish_reason: str | None) -> str:
    return {"length": "incomplete", "error": "failed"}.get(finish_reason, "completed")


def _whole(ctx: _Context, choices: list[Choice]) -> dict:
    (choice,) = choices
    message, finish_reason = chat_message(ctx.chat, choice)
    status = _status(finish_reason)
    output = []
    if message.get("content"):
        output.append(_message_item(message["content"], status))
    for call in message.get("tool_calls", ()):
        output.append(_call_item(call["id"], call["function"]["name"],
                                 call["function"]["arguments"]))
    return ctx.response(status, output, finish_reason=finish_reason)


def _message_item(text: str, status: str, item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status,
            "role": "assistant", "content": [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


async def _events(stream: AsyncIterable[tuple[int, StepOutput]], ctx: _Context,
                  num_choices: int, usage: Usage | None) -> AsyncIterator[str]:
    events = _EventWriter()
    yield events.emit("response.created", response=ctx.response("in_progress", []))
    yield events.emit("response.in_progress", response=ctx.response("in_progress", []))
    tools = ctx.chat.tool_output()
    finish_reason = None
    async for _, out in stream:
        if tools is None:
            deltas = [{"content": out.new_text}] if out.new_text else []
            finish_reason = out.finish_reason
        else:
            deltas = tools.feed(out.new_text)
            if out.finished:
                last, finish_reason = tools.finish(out.finish_reason)
                deltas += last
        for delta in deltas:
            for event in events.add(delta):
                yield event
    status = _status(finish_reason)
    for event in events.close(status):
        yield event
    final = "response.completed" if status == "completed" else f"response.{status}"
    yield events.emit(final, response=ctx.response(
        status, events.items, _usage(usage.as_dict()) if usage else None, finish_reason))


class _EventWriter:
    """Turns chat-shaped deltas (content, tool_calls) into Responses stream events."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._sequence = 0
        self._message: dict | None = None  # the open message item
        self._calls: dict[int, dict] = {}  # tool call index -> its function_call item

    def emit(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def add(self, delta: dict) -> list[str]:
        events = []
        if delta.get("content"):
            if self._message is None:
                self._message = _message_item("", "in_progress")
                self._message["content"] = []
                self.items.append(self._message)
                events.append(self.emit("response.output_item.added", output_index=self._index(
                    self._message), item=self._message))
                events.append(self.emit("response.content_part.added", **self._where(
                    self._message), content_index=0, part=_text_part("")))
                self._message["content"].append(_text_part(""))
            self._message["content"][0]["text"] += delta["content"]
            events.append(self.emit("response.output_text.delta", **self._where(self._message),
                                    content_index=0, delta=delta["content"], logprobs=[]))
        for part in delta.get("tool_calls", ()):
            events += self._add_call(part)
        return events

    def _add_call(self, part: dict) -> list[str]:
        events = []
        item = self._calls.get(part["index"])
        if item is None:
            events += self._close_message("completed")
            item = _call_item(part["id"], part["function"]["name"], "", "in_progress")
            self._calls[part["index"]] = item
            self.items.append(item)
            events.append(self.emit("response.output_item.added", output_index=self._index(item),
                                    item=dict(item)))
        arguments = part["function"].get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            events.append(self.emit("response.function_call_arguments.delta",
                                    **self._where(item), delta=arguments))
        return events

    def close(self, status: str) -> list[str]:
        events = self._close_message(status)
        for item in self._calls.values():
            item["status"] = status
            events.append(self.emit("response.function_call_arguments.done", **self._where(item),
                                    arguments=item["arguments"]))
            events.append(self.emit("response.output_item.done", output_index=self._index(item),
                                    item=item))
        return events

    def _close_message(self, status: str) -> list[str]:
        item, self._message = self._message, None
        if item is None:
            return []
        item["status"] = status
        where = self._where(item)
        part = item["content"][0]
        return [self.emit("response.output_text.done", **where, content_index=0,
                          text=part["text"], logprobs=[]),
                self.emit("response.content_part.done", **where, content_index=0, part=part),
                self.emit("response.output_item.done", output_index=where["output_index"],
                          item=item)]

    def _index(self, item: dict) -> int:
        return next(i for i, it in enumerate(self.items) if it is item)

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self._index(item)}
