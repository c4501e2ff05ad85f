"""POST /v1/completions: OpenAI's legacy completions, streamed or whole.

Prompts may be a string, a list of strings, token ids or a list of token-id
lists; each prompt gets `n` choices, indexed `prompt * n + i`. `echo` puts the
prompt in front of the text (when streaming, in the choice's first chunk, once
the prompt has been processed); with `logprobs` the prompt's tokens come first
in the logprobs too (`token_logprobs[0]` is null: nothing precedes the first
token). `echo` with `max_tokens: 0` answers the prompt alone, which is how
lm-evaluation-harness scores loglikelihoods. vLLM's `prompt_logprobs` adds the
prompt's logprobs in vLLM's shape to each choice.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request

from carpool.engine.output_stream import EngineInfo
from carpool.engine.tokenizer import encode_prompt
from carpool.outputs import PromptLogprobs, StepOutput
from carpool.sampling_params import SamplingParams
from carpool.server.generation import Choice, Usage, new_id, serve_generation
from carpool.server.logprobs import completion_logprobs, prompt_logprobs_body
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
    echo_only: bool  # echo with max_tokens 0: the generated token is left out
    logprobs: int | None
    vllm_prompt_logprobs: bool  # the body's `prompt_logprobs`: vLLM's field in each choice
    tokenizer: Any
    skip_special_tokens: bool = True  # as the generated text was made (text_offset follows it)

    def prompt_index(self, index: int) -> int:
        return index // self.n

    def echo_text(self, index: int) -> str:
        prompt = self.prompts[self.prompt_index(index)]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def prompt_token_ids(self, index: int) -> list[int]:
        prompt = self.prompts[self.prompt_index(index)]
        return encode_prompt(self.tokenizer, prompt) if isinstance(prompt, str) else prompt

    def prefix(self, index: int, prompt_logprobs: PromptLogprobs | None) -> tuple[str, dict | None]:
        """The echoed text of choice `index` and, with logprobs, its prompt's logprobs object
        (the text offset after it is where the generated tokens' offsets go on)."""
        if not self.echo:
            return "", None
        if self.logprobs is None or prompt_logprobs is None:
            return self.echo_text(index), None
        body, _ = completion_logprobs(self.tokenizer, self.prompt_token_ids(index),
                                      prompt_logprobs.positions(), 0)
        return self.echo_text(index), body

    def envelope(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices}


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request):
    def prepare(info: EngineInfo, params: SamplingParams) -> tuple[_Context, list]:
        prompts = body.prompts()
        ctx = _Context(new_id("cmpl"), int(time.time()), body.model or info.served_model_name,
                       prompts,
                       params.n, body.echo, body.echo_only, params.logprobs,
                       body.prompt_logprobs is not None, info.tokenizer,
                       params.skip_special_tokens)
        return ctx, prompts

    return await serve_generation(request, body, prepare, _events, _response)

def _response(ctx: _Context, choices: list[Choice]) -> dict:
    return ctx.envelope([_choice_body(ctx, c) for c in choices])


def _choice_body(ctx: _Context, choice: Choice) -> dict:
    echo_text, echo_logprobs = ctx.prefix(choice.index, choice.prompt_logprobs)
    generated = "" if ctx.echo_only else choice.text
    logprobs = echo_logprobs
    if ctx.logprobs is not None and not ctx.echo_only:
        offset = len(echo_text) if echo_logprobs is not None else 0
        logprobs = _joined(echo_logprobs, completion_logprobs(
            ctx.tokenizer, choice.token_ids, choice.logprobs, offset,
            skip_special_tokens=ctx.skip_special_tokens)[0])
    body = {"index": choice.index, "text": echo_text + generated, "logprobs": logprobs,
            "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
    if ctx.vllm_prompt_logprobs:
        body["prompt_logprobs"] = prompt_logprobs_body(ctx.tokenizer, choice.prompt_logprobs)
    return body


def _joined(first: dict | None, then: dict) -> dict:
    """Two legacy logprobs objects as one (the prompt's, then the generated tokens')."""
    if first is None:
        return then
    return {key: first[key] + then[key] for key in then}


def _chunk(ctx: _Context, index: int, text: str, logprobs: dict | None,
           out: StepOutput | None) -> str:
    choice = {"index": index, "text": text, "logprobs": logprobs,
              "finish_reason": out.finish_reason if out else None,
              "stop_reason": out.stop_reason if out else None}
    return sse_event(ctx.envelope([choice]))


async def _events(stream: AsyncIterable[tuple[int, StepOutput]], ctx: _Context,
                  num_choices: int, usage: Usage | None) -> AsyncIterator[str]:
    offsets = [0] * num_choices
    started = [False] * num_choices
    async for index, out in stream:
        if not started[index]:
            # The echo goes out with the choice's first output: then its prompt logprobs
            # exist, and a client timing the first chunk times the real first token.
            started[index] = True
            text, logprobs = ctx.prefix(index, out.prompt_logprobs)
            if ctx.echo:
                offsets[index] = len(text)
                yield _chunk(ctx, index, text, logprobs, out if ctx.echo_only else None)
        if ctx.echo_only:
            continue
        logprobs = None
        if ctx.logprobs is not None and out.new_token_ids:
            logprobs, offsets[index] = completion_logprobs(
                ctx.tokenizer, out.new_token_ids, out.new_logprobs or [], offsets[index],
                skip_special_tokens=ctx.skip_special_tokens)
        if out.new_text or logprobs or out.finished:
            yield _chunk(ctx, index, out.new_text, logprobs, out)
    if usage is not None:
        body = ctx.envelope([])
        body["usage"] = usage.as_dict()
        yield sse_event(body)
