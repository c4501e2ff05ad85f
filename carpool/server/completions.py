"""POST /v1/completions: OpenAI's legacy completions, streamed or whole.

Prompts may be a string, a list of strings, token ids or a list of token-id
lists; each prompt gets `n` choices, indexed `prompt * n + i`. `echo` puts the
prompt in front of the text (in the first chunk when streaming).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request

from carpool.engine.output_stream import EngineInfo
from carpool.outputs import StepOutput
from carpool.sampling_params import SamplingParams
from carpool.server.generation import Choice, Usage, new_id, serve_generation
from carpool.server.logprobs import completion_logprobs
from carpool.server.protocol import CompletionRequest
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
    def prepare(info: EngineInfo, params: SamplingParams) -> tuple[_Context, list]:
        prompts = body.prompts()
        ctx = _Context(new_id("cmpl"), int(time.time()), info.served_model_name, prompts,
                       params.n, body.echo, params.logprobs, info.tokenizer)
        return ctx, prompts

    return await serve_generation(request, body, prepare, _events, _response)

def _response(ctx: _Context, choices: list[Choice]) -> dict:
    return ctx.envelope([_choice_body(ctx, c) for c in choices])


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


async def _events(stream: AsyncIterable[tuple[int, StepOutput]], ctx: _Context,
                  num_choices: int, usage: Usage | None) -> AsyncIterator[str]:
    offsets = [0] * num_choices
    if ctx.echo:
        for index in range(num_choices):
            yield _chunk(ctx, index, ctx.echo_text(index), None, None)
    async for index, out in stream:
        logprobs = None
        if ctx.logprobs is not None and out.new_token_ids:
            logprobs, offsets[index] = completion_logprobs(
                ctx.tokenizer, out.new_token_ids, out.new_logprobs or [], offsets[index])
        if out.new_text or logprobs or out.finished:
            yield _chunk(ctx, index, out.new_text, logprobs, out)
    if usage is not None:
        body = ctx.envelope([])
        body["usage"] = usage.as_dict()
        yield sse_event(body)
