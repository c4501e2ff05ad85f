"""POST /v1/completions: OpenAI's legacy completions, streamed or whole.

Prompts may be a string, a list of strings, token ids or a list of token-id
lists; each prompt gets `n` choices, indexed `prompt * n + i`. `echo` puts the
prompt in front of the text (in the first chunk when streaming).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request

from carpool.engine.async_engine import OutputStream
from carpool.outputs import StepOutput
from carpool.server.errors import bad_request
from carpool.server.generation import (Choice, check_model, fan_out, new_id, note_cached,
                                       ready_engine, respond, usage)
from carpool.server.logprobs import completion_logprobs
from carpool.server.protocol import REQUEST_FIELDS, CompletionRequest
from carpool.server.sse import sse_event

router = APIRouter()


@dataclass(frozen=True)
class _Context:
    """What every chunk or response of one completion request repeats."""

    id: str
    created: int
    model: str
    prompts: list
    n: int
    echo: bool
    logprobs: int | None
    tokenizer: Any

    def prompt_index(self, index: int) -> int:
        return index // self.n

    def echo_text(self, index: int) -> str:
        prompt = self.prompts[self.prompt_index(index)]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def envelope(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices}


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request):
    engine = ready_engine(request)
    info = engine.info
    check_model(body.model, info)
    try:
        prompts = body.prompts()
        params = body.to_sampling_params(info.sampling_defaults)
        ctx = _Context(new_id("cmpl"), int(time.time()), info.served_model_name, prompts,
                       params.n, body.echo, params.logprobs, info.tokenizer)
        requests = fan_out(ctx.id, prompts, params, info, body.cache_salt)
    except ValueError as exc:
        raise bad_request(exc, REQUEST_FIELDS) from None
    return await respond(
        request, engine, requests, body.stream,
        lambda stream: _events(stream, ctx, len(requests), body.include_usage),
        lambda choices: _response(ctx, choices))

def _response(ctx: _Context, choices: list[Choice]) -> dict:
    body = ctx.envelope([_choice_body(ctx, c) for c in choices])
    prompt_tokens = {ctx.prompt_index(c.index): c.num_prompt_tokens for c in choices}
    cached_tokens: dict[int, int] = {}
    for c in choices:
        note_cached(cached_tokens, ctx.prompt_index(c.index), c.num_cached_tokens)
    body["usage"] = usage(prompt_tokens, sum(len(c.token_ids) for c in choices), cached_tokens)
    return body


def _choice_body(ctx: _Context, choice: Choice) -> dict:
    logprobs = None
    if ctx.logprobs is not None:
        logprobs, _ = completion_logprobs(ctx.tokenizer, choice.token_ids, choice.logprobs, 0)
    text = (ctx.echo_text(choice.index) if ctx.echo else "") + choice.text
    return {"index": choice.index, "text": text, "logprobs": logprobs,
            "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}


def _chunk(ctx: _Context, index: int, text: str, logprobs: dict | None,
           out: StepOutput | None) -> str:
    choice = {"index": index, "text": text, "logprobs": logprobs,
              "finish_reason": out.finish_reason if out else None,
              "stop_reason": out.stop_reason if out else None}
    return sse_event(ctx.envelope([choice]))


async def _events(stream: OutputStream, ctx: _Context, num_choices: int,
                  include_usage: bool) -> AsyncIterator[str]:
    offsets = [0] * num_choices
    prompt_tokens: dict[int, int] = {}
    cached_tokens: dict[int, int] = {}
    num_completion_tokens = 0
    if ctx.echo:
        for index in range(num_choices):
            yield _chunk(ctx, index, ctx.echo_text(index), None, None)
    async for index, out in stream:
        prompt_tokens[ctx.prompt_index(index)] = out.num_prompt_tokens
        note_cached(cached_tokens, ctx.prompt_index(index), out.num_cached_tokens)
        logprobs = None
        if ctx.logprobs is not None and out.new_token_ids:
            logprobs, offsets[index] = completion_logprobs(
                ctx.tokenizer, out.new_token_ids, out.new_logprobs or [], offsets[index])
        if out.finished:
            num_completion_tokens += out.num_output_tokens
        if out.new_text or logprobs or out.finished:
            yield _chunk(ctx, index, out.new_text, logprobs, out)
    if include_usage:
        body = ctx.envelope([])
        body["usage"] = usage(prompt_tokens, num_completion_tokens, cached_tokens)
        yield sse_event(body)
