"""What passes between the HTTP side and the engine's loop thread: requests in, deltas out.

An `OutputStream` belongs to one HTTP request (all its choices and prompts)
and is read by one asyncio task; the loop thread fills it through
`loop.call_soon_threadsafe`, never directly, so no lock is needed.

Flow control: when the reader falls behind (its client reads slower than the
engine generates, or not at all), the stream pauses its requests in the
engine, which then stops scheduling them and gives their seats to others; it
resumes them once the reader has caught up. A reader that falls much further
behind (what was in flight when it paused) is ended (`max_backlog`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from carpool.lora_request import LoRARequest
from carpool.outputs import StepOutput
from carpool.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The step loop has stopped; no request can be served any more."""


class ServerClosingError(RuntimeError):
    """The server is shutting down and ended this stream before its requests finished."""


class StreamBacklogError(RuntimeError):
    """The stream's reader fell `max_backlog` outputs behind: ended, its requests aborted."""


@dataclass(frozen=True)
class GenerationRequest:
    """One engine request: the server fans `n` and prompt lists out into several."""

    request_id: str
    prompt: str | list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side may know of the engine, captured once it is loaded."""

    served_model_name: str
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    kv_cache_info: dict
    tokenizer: Any  # the HTTP side's own copy: never shared with the loop thread
    # generation_config.json's sampling fields, for request fields left unset.
    sampling_defaults: dict = field(default_factory=dict)
    quantization: str | None = None  # the weights' format and types; None: float weights


class OutputStream:
    """The deltas of one HTTP request's engine requests, as `(index, StepOutput)`.

    Filled by the loop thread (through `call_soon_threadsafe`), read by one
    asyncio task. Iteration ends when every request has finished. `close()`
    aborts whatever is unfinished and is safe to call more than once.
    """

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop,
                 request_ids: list[str]) -> None:
        self._engine = engine
        self.loop = loop
        self.request_ids = list(request_ids)
        self._index = {rid: i for i, rid in enumerate(self.request_ids)}
        self._queue: asyncio.Queue = asyncio.Queue()
        self._admitted: asyncio.Future = loop.create_future()
        self._unfinished = set(self.request_ids)
        # Outputs that may wait unread before the stream is ended and its requests aborted
        # (a client that stops reading); None: no limit. The server sets it.
        self.max_backlog: int | None = None
        # Unread outputs at which the stream pauses its requests (at least one step's worth:
        # one output per unfinished request per step); None: never pauses. The server sets it.
        self.pause_backlog: int | None = None
        self._paused = False
        self._overflowed = False

    async def admitted(self) -> None:
        """Wait until the engine accepted every request; raises its ValueError if not."""
        await self._admitted

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> tuple[int, StepOutput]:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if self._paused and self._queue.empty() and self._unfinished:
            self._paused = False  # caught up
            self._engine.set_paused(sorted(self._unfinished), False)
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return self._index[item.request_id], item

    def close(self) -> None:
        """Abort the requests that have not finished (the client is gone or done)."""
        if self._unfinished:
            self._engine.abort(sorted(self._unfinished))
            self._unfinished.clear()

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` after what was already delivered; abort the unfinished.

        The reader sees the outputs queued so far, then `error` raised from iteration.
        """
        if self._unfinished:
            self._engine.abort(sorted(self._unfinished))
            self._queue.put_nowait(error)

    # Called on the event loop, scheduled by the loop thread.
    def _set_admitted(self, error: BaseException | None) -> None:
        if self._admitted.done():
            return
        if error is None:
            self._admitted.set_result(None)
        else:
            self._unfinished.clear()
            self._admitted.set_exception(error)

    def _put(self, item: StepOutput | BaseException) -> None:
        if self._overflowed:
            return  # ended: what the engine sent before the abort reached it is dropped
        self._queue.put_nowait(item)
        if (self.max_backlog is not None and self._unfinished
                and self._queue.qsize() > self.max_backlog):
            self._overflowed = True
            while not self._queue.empty():
                self._queue.get_nowait()
            self.fail(StreamBacklogError(
                f"this response's reader fell {self.max_backlog} outputs behind "
                "(--max-stream-backlog): it was ended and its requests aborted"))
        elif (self.pause_backlog is not None and not self._paused and self._unfinished
              and self._queue.qsize() >= max(self.pause_backlog, len(self._unfinished))):
            self._paused = True
            self._engine.set_paused(sorted(self._unfinished), True)


def put_all(batch: list[tuple[OutputStream, StepOutput]]) -> None:
    """Deliver one step's outputs to their streams (runs on the streams' event loop)."""
    for stream, out in batch:
        stream._put(out)


def notify(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    """Schedule `fn(*args)` on `loop` from another thread; a closed loop has no one to tell."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Resolve `future` with `result`, or fail it with `error` (on its loop); once only."""
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
