"""What both generation routes share: fan-out, admission, collecting, and disconnects.

A request with `n` choices over `k` prompts becomes `n * k` engine requests
`<id>-<index>` (choice `index = prompt * n + i`; with a seed, choice `i` of a
prompt gets `seed + i`, exactly as `LLM.generate` fans out), all in one
`OutputStream`. Whoever holds the stream must `close()` it when done, which
aborts whatever is unfinished: that is how a client that goes away frees its
KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from carpool.engine.output_builder import CompletionBuilder
from carpool.engine.output_stream import (
    EngineDeadError,
    EngineInfo,
    GenerationRequest,
    OutputStream,
    ServerClosingError,
    StreamBacklogError,
)
from carpool.engine.protocol import EngineClient
from carpool.lora_request import LoRARequest
from carpool.outputs import StepOutput
from carpool.sampling_params import SamplingParams, child_params
from carpool.server.admission import Admission
from carpool.server.constraints import check_grammar
from carpool.server.errors import APIError, bad_request, engine_error, not_found_model
from carpool.server.logprobs import check_logprob_work
from carpool.server.prompts import TokenizerWorker
from carpool.server.protocol import REQUEST_FIELDS, SamplingRequest
from carpool.server.sse import DONE, EventStreamResponse, sse_event

if TYPE_CHECKING:
    from carpool.server.lora_adapters import ServedAdapters

logger = logging.getLogger("carpool.server")

# A single HTTP request may not fan out into more engine requests than this.
MAX_CHOICES_PER_REQUEST = 4096


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def ready_engine(request: Request) -> EngineClient:
    """The app's engine, or a 503 while the model is loading or after the loop died."""
    engine: EngineClient = request.app.state.engine
    if engine.dead_error is not None:
        raise APIError(503, f"The engine has stopped: {engine.dead_error!r}", code="engine_dead")
    if not engine.is_ready:
        raise APIError(503, "The model is still loading.", code="model_loading",
                       headers={"Retry-After": "5"})
    return engine


def check_model(name: str | None, info: EngineInfo,
                adapters: ServedAdapters | None = None) -> LoRARequest | None:
    """The LoRA adapter `name` names (None: the model); 404 for a name served as neither."""
    if name is None or name == info.served_model_name:
        return None
    adapter = None if adapters is None else adapters.get(name)
    if adapter is None:
        raise not_found_model(name, info.served_model_name)
    return adapter


def check_request(body: SamplingRequest, info: EngineInfo,
                  adapters: ServedAdapters | None = None) -> LoRARequest | None:
    """The body's adapter (`check_model`); one warning naming the fields ignored."""
    adapter = check_model(body.model, info, adapters)
    if body.ignored_fields:
        logger.warning("The following fields were present in the request but ignored: %s",
                       ", ".join(body.ignored_fields))
    return adapter


def fan_out(base_id: str, prompts: list, params: SamplingParams,
            info: EngineInfo, cache_salt: str | None = None,
            lora_request: LoRARequest | None = None) -> list[GenerationRequest]:
    n = params.n
    if n > info.max_num_seqs:
        raise ValueError(f"n must be <= max_num_seqs ({info.max_num_seqs}), got {n}")
    if n * len(prompts) > MAX_CHOICES_PER_REQUEST:
        raise ValueError(f"prompt: n ({n}) x number of prompts ({len(prompts)}) must be <= "
                         f"{MAX_CHOICES_PER_REQUEST}")
    requests = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            child = child_params(params, i)  # the offline LLM's fan-out, seeds and all
            requests.append(GenerationRequest(f"{base_id}-{p * n + i}", prompt, child,
                                              cache_salt, lora_request))
    return requests


async def start(request: Request, engine: EngineClient,
                requests: list[GenerationRequest]) -> OutputStream:
    """Queue the requests through the app's admission gate and wait until the engine took them:
    a full queue is a 503, the engine's refusal a 400."""
    admission: Admission = request.app.state.admission
    try:
        return await admission.start(engine, requests)
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - refused by the engine
        raise _admission_error(exc) from None


def _admission_error(exc: Exception) -> APIError:
    if isinstance(exc, ValueError):
        return bad_request(exc, REQUEST_FIELDS)
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    return engine_error(f"{type(exc).__name__}: {exc}")


def stream_error(exc: EngineDeadError | ServerClosingError | StreamBacklogError) -> APIError:
    """The 503 a response ends with when the engine died or the server stopped under it, or
    its reader fell too far behind."""
    if isinstance(exc, StreamBacklogError):
        return APIError(503, str(exc), code="stream_backlog")
    code = "engine_dead" if isinstance(exc, EngineDeadError) else "server_shutting_down"
    return APIError(503, str(exc), code=code)


async def serve_generation(
        request: Request, body: SamplingRequest,
        prepare: Callable[[EngineInfo, SamplingParams], tuple[Any, list]],
        events: Callable[[AsyncIterable[tuple[int, StepOutput]], Any, int, Usage | None],
                         AsyncIterator[str]],
        build: Callable[[Any, list[Choice]], dict],
        shape_usage: Callable[[dict], dict] | None = None) -> Response:
    """The request -> generation -> response path both OpenAI routes take.

    `prepare(info, params)` returns the route's context (with its response `id`) and its
    prompts; a ValueError there, in the sampling fields or in the fan-out is a 400 naming
    the field. The engine requests carry the body's `cache_salt`. Then
    `prepare` and the tokenizing of text prompts run on the app's `TokenizerWorker` thread,
    never on the event loop, and the logprobs asked for are checked against
    `--max-logprob-work`. Then
    `events(stream, context, num_choices, usage)` streams (`usage`, counted from the stream
    here, is None unless the client asked for it in a last chunk), or `build(context,
    choices)` answers whole and the usage is added here (in `shape_usage`'s shape if given).
    """
    engine = ready_engine(request)
    info = engine.info
    adapter = check_request(body, info, request.app.state.lora_adapters)
    worker: TokenizerWorker = request.app.state.tokenizer_worker

    def prepare_ids(params: SamplingParams) -> tuple[Any, list, list[list[int]]]:
        context, prompts = prepare(info, params)
        return context, prompts, [worker.prompt_token_ids(info, p, params) for p in prompts]

    try:
        params = body.to_sampling_params(info.sampling_defaults)
        await check_grammar(request, body, params)
        # A client that leaves while its prompts wait for the tokenizer takes them along.
        context, prompts, prompt_ids = await until_disconnected(
            worker.run(prepare_ids, params), request)
        check_logprob_work(params, [len(ids) for ids in prompt_ids], info.max_model_len,
                           request.app.state.settings.max_logprob_work)
        requests = fan_out(context.id, prompt_ids, params, info, body.cache_salt, adapter)
    except ValueError as exc:
        raise bad_request(exc, REQUEST_FIELDS) from None
    usage = Usage(params.n)
    if engine.metrics is not None:
        engine.metrics.record_request_params(params.n, len(prompts))
    log_request(request, requests, prompts, body.stream)
    return await respond(
        request, engine, requests, body.stream,
        lambda stream: events(usage.counting(stream), context, len(requests),
                              usage if body.include_usage else None),
        lambda choices: {**build(context, choices),
                         "usage": (shape_usage or dict)(usage.of_choices(choices))})


async def respond(request: Request, engine: EngineClient, requests: list[GenerationRequest],
                  streaming: bool, events: Callable[[OutputStream], AsyncIterator[str]],
                  build: Callable[[list[Choice]], dict]) -> Response:
    """Start the requests, then stream `events(stream)` or answer `build(choices)` whole."""
    stream = await start(request, engine, requests)
    admission: Admission = request.app.state.admission
    if streaming:
        # Flow control and the backlog limit follow a client's reads; a whole response is
        # read here, by collect, and is neither paused nor cut off.
        settings = request.app.state.settings
        stream.max_backlog = settings.max_stream_backlog
        stream.pause_backlog = settings.stream_pause_backlog or None
        failures = _FailureWatch(stream)
        return EventStreamResponse(_ended(events(failures), failures),
                                   on_close=lambda: admission.release(stream))
    try:
        choices = await collect(stream, request, len(requests))
    finally:
        admission.release(stream)
    # Off the event loop: with logprobs a reply is megabytes of JSON, seconds of Python that
    # would freeze every stream and /health.
    return await asyncio.to_thread(lambda: ChunkedJSONResponse(build(choices)))


class ChunkedJSONResponse(JSONResponse):
    """A JSON reply handed to the transport in slices, each once the previous one has left
    its buffer: a multi-megabyte reply written at once sits in asyncio's buffer, which
    shrinks by a copy of everything left after every send (quadratic in the size)."""

    slice_bytes = 64 * 1024

    def render(self, content: Any) -> bytes:
        """Each choice serialized on its own: json's C encoder holds the GIL for a whole call,
        which for a whole multi-megabyte reply would freeze the event loop as well."""
        choices = content.get("choices") if isinstance(content, dict) else None
        if not isinstance(choices, list) or len(choices) < 2:
            return super().render(content)
        render = super().render
        head = render({**content, "choices": []})
        end = head.index(b'"choices":[]') + len(b'"choices":[')  # the first: keys come first
        return head[:end] + b",".join([render(c) for c in choices]) + head[end:]

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        body = memoryview(self.body)
        for start in range(0, len(body), self.slice_bytes):
            await send({"type": "http.response.body",
                        "body": bytes(body[start:start + self.slice_bytes]),
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def log_request(request: Request, requests: list[GenerationRequest], prompts: list,
                streaming: bool) -> None:
    """One log line per HTTP request with --enable-log-requests; the prompts as sent (text,
    token ids, or the chat prompt's ids) only with --log-prompts."""
    settings = request.app.state.settings
    if not requests or not settings.log_requests or not logger.isEnabledFor(logging.INFO):
        return
    params = requests[0].sampling_params
    line = (f"request {requests[0].request_id.rsplit('-', 1)[0]}: {len(requests)} generation(s), "
            f"max_tokens={params.max_tokens}, temperature={params.temperature}, "
            f"stream={streaming}")
    if settings.log_prompts:
        line += f", prompts={' '.join(dict.fromkeys(repr(p) for p in prompts))}"
    logger.info(line)


async def _ended(events: AsyncIterator[str], failures: _FailureWatch) -> AsyncIterator[str]:
    """The route's events, an error event if the engine died or the server is stopping, or
    naming why the first failed choice failed (its chunk said only `finish_reason: error`),
    and always `[DONE]`."""
    try:
        async for event in events:
            yield event
    except (EngineDeadError, ServerClosingError, StreamBacklogError) as exc:
        yield sse_event(stream_error(exc).body())
    else:
        if failures.first is not None:
            yield sse_event(engine_error(failures.first.error or "unknown error",
                                         failures.first.error_code).body())
    yield DONE


class _FailureWatch:
    """An `OutputStream`'s (index, delta) pairs, keeping the first that finished with `error`."""

    def __init__(self, stream: OutputStream) -> None:
        self._stream = stream
        self.first: StepOutput | None = None

    def __aiter__(self) -> _FailureWatch:
        return self

    async def __anext__(self) -> tuple[int, StepOutput]:
        index, out = await self._stream.__anext__()
        if out.finish_reason == "error" and self.first is None:
            self.first = out
        return index, out


@dataclass
class Choice(CompletionBuilder):
    """One choice folded from its deltas (the offline `LLM`'s builder), plus its prompt size."""

    num_prompt_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self.text_chunks)

    def add(self, out: StepOutput) -> None:
        super().add(out)
        self.num_prompt_tokens = out.num_prompt_tokens


async def collect(stream: OutputStream, request: Request, num_choices: int) -> list[Choice]:
    """Fold every delta into its choice; stop early (a 499) if the client disconnects."""
    choices = [Choice(i, want_logprobs=True) for i in range(num_choices)]

    async def consume() -> None:
        async for index, out in stream:
            choices[index].add(out)

    try:
        await until_disconnected(consume(), request)
    except (EngineDeadError, ServerClosingError, StreamBacklogError) as exc:
        raise stream_error(exc) from None
    failed = [c for c in choices if c.finish_reason == "error"]
    if failed:
        raise engine_error(failed[0].error or "unknown error", failed[0].error_code)
    return choices


async def until_disconnected(coro, request: Request):
    """Run `coro`; if the client disconnects first, cancel it and raise a 499 APIError."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise APIError(499, "The client closed the connection.", code="client_disconnected")
    finally:
        task.cancel()
        watcher.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Usage:
    """OpenAI's usage block of one HTTP request, tallied here for both routes.

    Prompt tokens, and those of them served from the prefix cache
    (`prompt_tokens_details.cached_tokens`, the most any of the prompt's choices
    found), count once per prompt however many choices share it; completion
    tokens once per choice. Choice `index` belongs to prompt `index // n`.
    """

    def __init__(self, n: int) -> None:
        self._n = n
        self._prompt_tokens: dict[int, int] = {}
        self._cached_tokens: dict[int, int] = {}
        self._completion_tokens = 0

    def add(self, index: int, num_prompt_tokens: int, num_cached_tokens: int,
            num_completion_tokens: int) -> None:
        prompt = index // self._n
        self._prompt_tokens[prompt] = num_prompt_tokens
        self._cached_tokens[prompt] = max(self._cached_tokens.get(prompt, 0), num_cached_tokens)
        self._completion_tokens += num_completion_tokens

    def counting(self, stream: OutputStream) -> _CountedStream:
        """`stream`'s deltas, each added as it passes (a streamed response's usage)."""
        return _CountedStream(stream, self)

    def of_choices(self, choices: list[Choice]) -> dict:
        """The usage of a whole response's choices."""
        for c in choices:
            self.add(c.index, c.num_prompt_tokens, c.num_cached_tokens, len(c.token_ids))
        return self.as_dict()

    def as_dict(self) -> dict:
        num_prompt_tokens = sum(self._prompt_tokens.values())
        return {"prompt_tokens": num_prompt_tokens,
                "completion_tokens": self._completion_tokens,
                "total_tokens": num_prompt_tokens + self._completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self._cached_tokens.values())}}


class _CountedStream:
    """An `OutputStream`'s (index, delta) pairs, added to a `Usage` on the way."""

    def __init__(self, stream: OutputStream, usage: Usage) -> None:
        self._stream = stream
        self._usage = usage

    def __aiter__(self) -> _CountedStream:
        return self

    async def __anext__(self) -> tuple[int, StepOutput]:
        index, out = await self._stream.__anext__()
        self._usage.add(index, out.num_prompt_tokens, out.num_cached_tokens,
                        out.num_output_tokens if out.finished else 0)
        return index, out
