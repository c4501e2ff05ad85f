"""POST /v1/chat/completions: messages through the model's chat template.

Streaming sends, per choice, the role in a first delta (when the choice's first
output is ready, just before it), then content deltas,
then a delta carrying `finish_reason`; with `stream_options.include_usage`
one last chunk has empty `choices` and the usage.
"""

from __future__ import annotations

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

router = APIRouter()


@dataclass(frozen=True)
class _Context:
    id: str
    created: int
    model: str
    num_top_logprobs: int | None  # None: no logprobs asked
    tokenizer: Any
    vllm_prompt_logprobs: bool = False  # vLLM's `prompt_logprobs`, on the whole response

    def envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def logprobs(self, token_ids: list[int], positions: list) -> dict | None:
        if self.num_top_logprobs is None or not token_ids:
            return None
        return chat_logprobs(self.tokenizer, token_ids, positions, self.num_top_logprobs)


def render_chat_prompt(tokenizer: Any, messages: list[ChatMessage],
                       add_generation_prompt: bool = True, *,
                       max_tokens: int | None = None) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template; ValueError if it can't,
    or (with `max_tokens`) if they are surely longer than that."""
    if not messages:
        raise ValueError("messages must hold at least one message")
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        return encode_chat(tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                           max_tokens=max_tokens)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template that fails on these messages
        raise ValueError(f"messages could not be rendered with the model's chat template: "
                         f"{type(exc).__name__}: {exc}") from None


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    def prepare(info: EngineInfo, params: SamplingParams) -> tuple[_Context, list]:
        prompt_ids = render_chat_prompt(info.tokenizer, body.messages, body.add_generation_prompt,
                                        max_tokens=info.max_model_len)
        ctx = _Context(new_id("chatcmpl"), int(time.time()), info.served_model_name,
                       params.logprobs if body.logprobs else None, info.tokenizer,
                       params.prompt_logprobs is not None)
        return ctx, [prompt_ids]

    return await serve_generation(request, body, prepare, _events, _response)

def _response(ctx: _Context, choices: list[Choice]) -> dict:
    body = ctx.envelope("chat.completion", [
        {"index": c.index, "message": {"role": "assistant", "content": c.text},
         "logprobs": ctx.logprobs(c.token_ids, c.logprobs),
         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        for c in choices])
    if ctx.vllm_prompt_logprobs:
        body["prompt_logprobs"] = prompt_logprobs_body(ctx.tokenizer, choices[0].prompt_logprobs)
    return body


def _chunk(ctx: _Context, index: int, delta: dict, logprobs: dict | None,
           finish_reason: str | None) -> str:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return sse_event(ctx.envelope("chat.completion.chunk", [choice]))


async def _events(stream: AsyncIterable[tuple[int, StepOutput]], ctx: _Context,
                  num_choices: int, usage: Usage | None) -> AsyncIterator[str]:
    started = [False] * num_choices
    async for index, out in stream:
        if not started[index]:
            # The role goes out with the choice's first output, not before the prefill, so
            # clients that time the first chunk measure the real time to first token (vLLM).
            started[index] = True
            yield _chunk(ctx, index, {"role": "assistant", "content": ""}, None, None)
        delta = {"content": out.new_text} if out.new_text else {}
        logprobs = ctx.logprobs(out.new_token_ids, out.new_logprobs or [])
        if delta or logprobs or out.finished:
            yield _chunk(ctx, index, delta, logprobs, out.finish_reason)
    if usage is not None:
        body = ctx.envelope("chat.completion.chunk", [])
        body["usage"] = usage.as_dict()
        yield sse_event(body)
