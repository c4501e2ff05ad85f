"""POST /v1/chat/completions: messages through the model's chat template.

Streaming sends, per choice, the role in a first delta, then content deltas,
then a delta carrying `finish_reason`; with `stream_options.include_usage`
one last chunk has empty `choices` and the usage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request

from carpool.engine.async_engine import OutputStream
from carpool.engine.tokenizer import encode_chat
from carpool.server.errors import bad_request
from carpool.server.generation import (Choice, check_model, fan_out, new_id, note_cached,
                                       ready_engine, respond, usage)
from carpool.server.logprobs import chat_logprobs
from carpool.server.protocol import REQUEST_FIELDS, ChatCompletionRequest, ChatMessage
from carpool.server.sse import sse_event

router = APIRouter()


@dataclass(frozen=True)
class _Context:
    id: str
    created: int
    model: str
    num_top_logprobs: int | None  # None: no logprobs asked
    tokenizer: Any

    def envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def logprobs(self, token_ids: list[int], positions: list) -> dict | None:
        if self.num_top_logprobs is None or not token_ids:
            return None
        return chat_logprobs(self.tokenizer, token_ids, positions, self.num_top_logprobs)


def render_chat_prompt(tokenizer: Any, messages: list[ChatMessage],
                       add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template; ValueError if it can't."""
    if not messages:
        raise ValueError("messages must hold at least one message")
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        return encode_chat(tokenizer, conversation, add_generation_prompt=add_generation_prompt)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template that fails on these messages
        raise ValueError(f"messages could not be rendered with the model's chat template: "
                         f"{type(exc).__name__}: {exc}") from None


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    engine = ready_engine(request)
    info = engine.info
    check_model(body.model, info)
    try:
        params = body.to_sampling_params(info.sampling_defaults)
        prompt_ids = render_chat_prompt(info.tokenizer, body.messages, body.add_generation_prompt)
        ctx = _Context(new_id("chatcmpl"), int(time.time()), info.served_model_name,
                       params.logprobs if body.logprobs else None, info.tokenizer)
        requests = fan_out(ctx.id, [prompt_ids], params, info, body.cache_salt)
    except ValueError as exc:
        raise bad_request(exc, REQUEST_FIELDS) from None
    return await respond(
        request, engine, requests, body.stream,
        lambda stream: _events(stream, ctx, len(requests), body.include_usage),
        lambda choices: _response(ctx, choices))

def _response(ctx: _Context, choices: list[Choice]) -> dict:
    body = ctx.envelope("chat.completion", [
        {"index": c.index, "message": {"role": "assistant", "content": c.text},
         "logprobs": ctx.logprobs(c.token_ids, c.logprobs),
         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        for c in choices])
    prompt_tokens = {0: choices[0].num_prompt_tokens} if choices else {}
    cached_tokens = {0: max(c.num_cached_tokens for c in choices)} if choices else {}
    body["usage"] = usage(prompt_tokens, sum(len(c.token_ids) for c in choices), cached_tokens)
    return body


def _chunk(ctx: _Context, index: int, delta: dict, logprobs: dict | None,
           finish_reason: str | None) -> str:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return sse_event(ctx.envelope("chat.completion.chunk", [choice]))


async def _events(stream: OutputStream, ctx: _Context, num_choices: int,
                  include_usage: bool) -> AsyncIterator[str]:
    num_prompt_tokens = 0
    cached_tokens: dict[int, int] = {}
    num_completion_tokens = 0
    for index in range(num_choices):
        yield _chunk(ctx, index, {"role": "assistant", "content": ""}, None, None)
    async for index, out in stream:
        num_prompt_tokens = out.num_prompt_tokens
        note_cached(cached_tokens, 0, out.num_cached_tokens)
        delta = {"content": out.new_text} if out.new_text else {}
        logprobs = ctx.logprobs(out.new_token_ids, out.new_logprobs or [])
        if out.finished:
            num_completion_tokens += out.num_output_tokens
        if delta or logprobs or out.finished:
            yield _chunk(ctx, index, delta, logprobs, out.finish_reason)
    if include_usage:
        body = ctx.envelope("chat.completion.chunk", [])
        body["usage"] = usage({0: num_prompt_tokens}, num_completion_tokens, cached_tokens)
        yield sse_event(body)
