"""The engine behind the HTTP server: one thread owns it, everyone else sends commands.

Shaped like TGI's router. The loop thread builds the `LLMEngine`, then runs
its step loop; nothing else ever touches engine or scheduler state. Requests
and aborts arrive through a thread-safe command queue, drained before every
step; each HTTP request gets an `OutputStream` that the loop thread fills via
`loop.call_soon_threadsafe`. With nothing to run the thread blocks on the
queue (no busy spin). After every step it publishes a stats snapshot (read by
/metrics and /health) and records per-step metrics.

Closing a stream aborts its unfinished requests; the engine frees their KV
blocks when the abort command is handled, i.e. before the next step. If the
loop dies with an exception that the engine could not contain, every open
stream gets `EngineDeadError` and `on_fatal` is called (the server exits).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from carpool.engine.commands import (
    AbortRequests,
    AddRequests,
    CallEngine,
    Command,
    EngineSnapshot,
    PauseRequests,
    Stop,
)
from carpool.engine.output_stream import (
    EngineDeadError,
    EngineInfo,
    GenerationRequest,
    OutputStream,
    notify,
    put_all,
    settle,
)
from carpool.engine.protocol import EngineClientBase, EngineCore, close_engine
from carpool.engine.utility import UTILITIES
from carpool.outputs import StepOutput

logger = logging.getLogger(__name__)


class AsyncEngine(EngineClientBase):
    """Runs an `LLMEngine` on its own thread; see the module docstring."""

    def __init__(self, engine_factory: Callable[[], EngineCore], *,
                 metrics_factory: Callable[[EngineInfo], Any] | None = None,
                 on_ready: Callable[[EngineInfo], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        super().__init__(metrics_factory, on_ready, on_fatal)
        self._factory = engine_factory
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}  # loop thread only
        self._num_requests_taken = 0  # requests of every add command handled so far
        self._thread = threading.Thread(target=self._run, name="carpool-engine", daemon=True)

    # ---- HTTP side -------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def add(self, requests: list[GenerationRequest]) -> OutputStream:
        """Queue requests for the engine; await `admitted()` on the stream, then iterate it."""
        stream = OutputStream(self, asyncio.get_running_loop(), [r.request_id for r in requests])
        with self._lock:
            if self._dead is None:
                self._commands.put(AddRequests(list(requests), stream, time.monotonic()))
                return stream
        stream._set_admitted(EngineDeadError(f"the engine has stopped: {self._dead!r}"))
        return stream

    def abort(self, request_ids: list[str]) -> None:
        with self._lock:
            if self._dead is None:
                self._commands.put(AbortRequests(list(request_ids)))

    def set_paused(self, request_ids: list[str], paused: bool) -> None:
        """Flow control from a stream whose reader is behind (or caught up again)."""
        with self._lock:
            if self._dead is None:
                self._commands.put(PauseRequests(list(request_ids), paused))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(llm_engine)` on the loop thread between two steps and return its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine has stopped: {self._dead!r}")
            self._commands.put(CallEngine(fn, future, loop))
        return await future

    def fail(self, error: BaseException) -> None:
        """From any thread: the engine can no longer step (e.g. a tensor-parallel rank died);
        the loop thread dies with `error` as if a step had raised it."""
        with self._lock:
            if self._dead is None:
                self._commands.put(Stop(error))
    async def call_utility(self, name: str, *args) -> Any:
        """Run `engine.utility.UTILITIES[name](engine, *args)` on the loop thread between two
        steps."""
        return await self.call(lambda engine: UTILITIES[name](engine, *args))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread; open streams get EngineDeadError."""
        with self._lock:
            if self._dead is None:
                self._commands.put(Stop())
        self._thread.join(timeout)

    # ---- loop thread -----------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._factory()
            self._on_loaded(engine)
        except BaseException as exc:  # noqa: BLE001 - anything here means no engine
            self._die(exc, "loading the model failed")
            return
        self._ready.set()
        if hasattr(engine, "notify_on_failure"):
            engine.notify_on_failure(self.fail)
        try:
            if self.on_ready is not None:
                self.on_ready(self.info)
            self._loop(engine)
        except BaseException as exc:  # noqa: BLE001 - the step loop cannot continue
            self._die(exc, "the engine step loop failed")
            return
        finally:
            close_engine(engine)
        self._die(EngineDeadError("the engine was shut down"), None)

    def _on_loaded(self, engine: EngineCore) -> None:
        try:
            tokenizer = copy.deepcopy(engine.tokenizer)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared
            tokenizer = engine.tokenizer
        self.info = EngineInfo(
            served_model_name=engine.served_model_name, max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size, max_num_seqs=engine.max_num_seqs,
            kv_cache_info=engine.kv_cache_info, tokenizer=tokenizer,
            sampling_defaults=dict(engine.sampling_defaults), quantization=engine.quantization)
        if self._metrics_factory is not None:
            self.metrics = self._metrics_factory(self.info)
        self._publish(engine)

    def _loop(self, engine: EngineCore) -> None:
        while True:
            commands = self._take_commands(block=not engine.has_unfinished_requests())
            for command in commands:
                if isinstance(command, Stop):
                    if command.error is not None:
                        raise command.error
                    return
                self._handle(engine, command)
            if commands:
                self._publish(engine)  # aborts freed blocks: show it before the next step
            if not engine.has_unfinished_requests():
                continue
            outputs = engine.step()
            now = time.monotonic()
            self._deliver(outputs)
            snapshot = self._publish(engine)
            if self.metrics is not None:
                self.metrics.record_step(outputs, snapshot.stats, now)

    def _take_commands(self, block: bool) -> list[Command]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, engine: EngineCore, command: Command) -> None:
        if isinstance(command, AddRequests):
            self._add(engine, command)
        elif isinstance(command, AbortRequests):
            live = [rid for rid in command.request_ids
                    if self._streams.pop(rid, None) is not None]
            if live:
                engine.abort_request(live)
        elif isinstance(command, PauseRequests):
            engine.set_paused([rid for rid in command.request_ids if rid in self._streams],
                              command.paused)
        elif isinstance(command, CallEngine):
            try:
                result, error = command.fn(engine), None
            except Exception as exc:  # noqa: BLE001 - handed back to the caller
                result, error = None, exc
            notify(command.loop, settle, command.future, result, error)

    def _add(self, engine: EngineCore, command: AddRequests) -> None:
        self._num_requests_taken += len(command.requests)
        stream = command.stream
        added: list[str] = []
        try:
            for r in command.requests:
                engine.add_request(r.request_id, r.prompt, r.sampling_params,
                                   arrival_time=command.arrival_time,
                                   cache_salt=r.cache_salt, lora_request=r.lora_request)
                added.append(r.request_id)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            if added:
                engine.abort_request(added)
            notify(stream.loop, stream._set_admitted, exc)
            return
        for rid in added:
            self._streams[rid] = stream
        notify(stream.loop, stream._set_admitted, None)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        """Hand each output to its stream: one thread-safe call per event loop per step."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, StepOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted: its client is gone
            if out.finished:
                del self._streams[out.request_id]
            batches.setdefault(stream.loop, []).append((stream, out))
        for loop, batch in batches.items():
            notify(loop, put_all, batch)

    def _publish(self, engine: EngineCore) -> EngineSnapshot:
        snapshot = EngineSnapshot(engine.stats(), time.monotonic(), self._num_requests_taken)
        self._snapshot = snapshot
        if self.metrics is not None:
            self.metrics.update_gauges(snapshot.stats)
        return snapshot

    def _die(self, exc: BaseException, what: str | None) -> None:
        if what is not None:
            logger.critical("%s: %r", what, exc, exc_info=exc)
        with self._lock:
            self._dead = exc
            pending = self._take_commands(block=False)
        self._ready.set()
        if what is not None and self.on_fatal is not None:
            try:  # first, so the server is already stopping when clients hear of it
                self.on_fatal(exc)
            except Exception:  # the streams below must still be told
                logger.exception("on_fatal failed")
        error = EngineDeadError(f"the engine has stopped: {exc!r}")
        for command in pending:
            if isinstance(command, AddRequests):
                notify(command.stream.loop, command.stream._set_admitted, error)
            elif isinstance(command, CallEngine):
                notify(command.loop, settle, command.future, None, error)
        for stream in {id(s): s for s in self._streams.values()}.values():
            notify(stream.loop, stream._put, error)
        self._streams.clear()
