"""POST /v1/chat/completions: messages through the model's chat template.

Streaming sends, per choice, the role in a first delta (when the choice's first
output is ready, just before it), then content deltas,
then a delta carrying `finish_reason`; with `stream_options.include_usage`
one last chunk has empty `choices` and the usage. With tools, the template
renders them, and each choice's text becomes content and `tool_calls`
(`server/tool_output.py`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request

from carpool.engine.output_stream import EngineInfo
from carpool.engine.tokenizer import encode_chat
from carpool.outputs import StepOutput
from carpool.sampling_params import SamplingParams
from carpool.server.generation import Choice, Usage, new_id, serve_generation
from carpool.server.logprobs import chat_logprobs, prompt_logprobs_body
from carpool.server.protocol import ChatCompletionRequest, ChatMessage
from carpool.server.sse import sse_event
from carpool.server.tool_output import ToolOutput
from carpool.server.tool_parsers import get_parser
from carpool.server.tools import ToolChoice

router = APIRouter()


@dataclass(frozen=True)
class ChatContext:
    id: str
    created: int
    model: str
    num_top_logprobs: int | None  # None: no logprobs asked
    tokenizer: Any
    vllm_prompt_logprobs: bool = False  # vLLM's `prompt_logprobs`, on the whole response
    tool_choice: ToolChoice | None = None  # None: plain text (no tools, or tool_choice none)
    tool_call_parser: str | None = None

    def tool_output(self) -> ToolOutput | None:
        if self.tool_choice is None:
            return None
        parser = get_parser(self.tool_call_parser) if self.tool_call_parser else None
        return ToolOutput(self.tool_choice, parser)

    def envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def logprobs(self, token_ids: list[int], positions: list) -> dict | None:
        if self.num_top_logprobs is None or not token_ids:
            return None
        return chat_logprobs(self.tokenizer, token_ids, positions, self.num_top_logprobs)


def render_chat_prompt(tokenizer: Any, messages: list[ChatMessage],
                       add_generation_prompt: bool = True,
                       tools: list[dict] | None = None, *,
                       max_tokens: int | None = None) -> list[int]:
    """Token ids of `messages` (and `tools`) through the tokenizer's chat template;
    ValueError if it can't, or (with `max_tokens`) if they are surely longer than that."""
    if not messages:
        raise ValueError("messages must hold at least one message")
    conversation = [_template_message(m) for m in messages]
    extra = {"tools": tools} if tools else {}
    try:
        return encode_chat(tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                           max_tokens=max_tokens, **extra)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template that fails on these messages
        raise ValueError(f"messages could not be rendered with the model's chat template: "
                         f"{type(exc).__name__}: {exc}") from None


def _template_message(message: ChatMessage) -> dict:
    """A message as chat templates read it: earlier tool calls' arguments decoded to objects
    (templates write them with `tojson`), the tool message's call id kept."""
    rendered: dict = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _decoded(c.function.arguments)}}
            for c in message.tool_calls]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _decoded(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    settings = request.app.state.settings
    return await serve_generation(
        request, body, lambda info, params: prepare_chat(body, info, params, settings),
        _events, _response)


def prepare_chat(body: ChatCompletionRequest, info: EngineInfo, params: SamplingParams,
                 settings: Any) -> tuple[ChatContext, list]:
    """The context and the one rendered prompt of a chat request (also /v1/responses')."""
    tool_choice = body.tool_choice_of(settings.enable_auto_tool_choice)
    prompt_ids = render_chat_prompt(info.tokenizer, body.messages, body.add_generation_prompt,
                                    body.tools, max_tokens=info.max_model_len)
    ctx = ChatContext(new_id("chatcmpl"), int(time.time()), body.model or info.served_model_name,
                      params.logprobs if body.logprobs else None, info.tokenizer,
                      vllm_prompt_logprobs=params.prompt_logprobs is not None,
                      tool_choice=None if tool_choice.mode == "none" else tool_choice,
                      tool_call_parser=settings.tool_call_parser)
    return ctx, [prompt_ids]


def _response(ctx: ChatContext, choices: list[Choice]) -> dict:
    body = ctx.envelope("chat.completion", [_choice(ctx, c) for c in choices])
    if ctx.vllm_prompt_logprobs:
        body["prompt_logprobs"] = prompt_logprobs_body(ctx.tokenizer, choices[0].prompt_logprobs)
    return body


def chat_message(ctx: ChatContext, c: Choice) -> tuple[dict, str | None]:
    """A finished choice's `message` (content and tool calls) and its finish reason."""
    tools = ctx.tool_output()
    if tools is None:
        return {"role": "assistant", "content": c.text}, c.finish_reason
    return tools.message(c.text, c.finish_reason)


def _choice(ctx: ChatContext, c: Choice) -> dict:
    message, finish_reason = chat_message(ctx, c)
    return {"index": c.index, "message": message,
            "logprobs": ctx.logprobs(c.token_ids, c.logprobs),
            "finish_reason": finish_reason, "stop_reason": c.stop_reason}


def _chunk(ctx: ChatContext, index: int, delta: dict, logprobs: dict | None,
           finish_reason: str | None) -> str:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return sse_event(ctx.envelope("chat.completion.chunk", [choice]))


async def _events(stream: AsyncIterable[tuple[int, StepOutput]], ctx: ChatContext,
                  num_choices: int, usage: Usage | None) -> AsyncIterator[str]:
    tools = [ctx.tool_output() for _ in range(num_choices)]
    started = [False] * num_choices
    async for index, out in stream:
        if not started[index]:
            # The role goes out with the choice's first output, not before the prefill, so
            # clients that time the first chunk measure the real time to first token (vLLM).
            started[index] = True
            yield _chunk(ctx, index, {"role": "assistant", "content": ""}, None, None)
        logprobs = ctx.logprobs(out.new_token_ids, out.new_logprobs or [])
        if tools[index] is None:
            delta = {"content": out.new_text} if out.new_text else {}
            if delta or logprobs or out.finished:
                yield _chunk(ctx, index, delta, logprobs, out.finish_reason)
            continue
        deltas = tools[index].feed(out.new_text)
        finish_reason = None
        if out.finished:
            last, finish_reason = tools[index].finish(out.finish_reason)
            deltas += last
        deltas = deltas or ([{}] if logprobs or out.finished else [])
        for i, delta in enumerate(deltas):
            last_delta = i == len(deltas) - 1
            yield _chunk(ctx, index, delta, logprobs if i == 0 else None,
                         finish_reason if last_delta else None)
    if usage is not None:
        body = ctx.envelope("chat.completion.chunk", [])
        body["usage"] = usage.as_dict()
        yield sse_event(body)
