"""The front end's handle on one engine-core process (`core_process.py`).

`EngineProcessClient` offers what the server needs of an engine (`protocol.EngineClient`,
which the in-process `AsyncEngine` offers too): `add` requests and get an
`OutputStream`, `abort`, `call_utility`, the latest `snapshot`, `info` once
ready, and a death that every open stream hears of. Each instance owns one
process and one connection, so a data-parallel front end can hold several and
route requests between them.

Two threads of the HTTP process serve the connection, so the event loop never
waits on a pipe: a sender (commands queued by the event loop, pickled and
written in order) and a receiver, which for each `StepBatch` runs the
`OutputProcessor` (detokenization and stop strings), hands the deltas to their
streams with one `call_soon_threadsafe` per event loop, aborts requests a stop
string ended, and records the step's Prometheus metrics. The engine's own
process never renders /metrics nor decodes text.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from carpool.config import EngineConfig
from carpool.engine.core_messages import (
    AbortRequests,
    Admitted,
    EngineFailed,
    EngineReady,
    PauseRequests,
    StepBatch,
    Stop,
    SubmitRequests,
    UtilityCall,
    UtilityResult,
)
from carpool.engine.core_process import run_engine_core
from carpool.engine.dp_routing import OutstandingWork
from carpool.engine.output_processor import OutputProcessor
from carpool.engine.output_stream import (
    EngineDeadError,
    EngineInfo,
    GenerationRequest,
    OutputStream,
    notify,
    put_all,
    settle,
)
from carpool.engine.protocol import EngineClientBase
from carpool.engine.tokenizer import load_engine_tokenizer

logger = logging.getLogger(__name__)


class EngineProcessClient(EngineClientBase):
    """Starts, feeds and watches one engine-core process; see the module docstring."""

    def __init__(self, config: EngineConfig, *, log_level: str = "info",
                 metrics_factory: Callable[[EngineInfo], Any] | None = None,
                 on_ready: Callable[[EngineInfo], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        super().__init__(metrics_factory, on_ready, on_fatal)
        self._config = config
        self._log_level = log_level
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # None ends the sender
        self._ids = itertools.count()
        self._pending: dict[int, tuple[OutputStream, list[GenerationRequest]]] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._streams: dict[str, OutputStream] = {}  # receiver thread only
        self._processor: OutputProcessor | None = None
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self.work = OutstandingWork()  # what it was sent and has not finished: a router's load

    # ---- the event loop's side -------------------------------------------------------
    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe(duplex=True)
        self._process = context.Process(
            target=run_engine_core, args=(self._config, child_conn, self._log_level),
            # Not a daemon, so that it may start processes of its own (tensor-parallel
            # workers); `shutdown`, which `serve` always reaches, ends it.
            name=_process_name(self._config), daemon=False)
        self._process.start()
        child_conn.close()  # the child's end lives in the child only: its exit is our EOF
        self._threads = [threading.Thread(target=target, name=name, daemon=True)
                         for target, name in ((self._send_loop, "carpool-engine-send"),
                                              (self._receive_loop, "carpool-engine-receive"))]
        for thread in self._threads:
            thread.start()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def add(self, requests: list[GenerationRequest]) -> OutputStream:
        """Queue requests (token-id prompts) for the engine; await `admitted()` on the stream,
        then iterate it."""
        stream = OutputStream(self, asyncio.get_running_loop(), [r.request_id for r in requests])
        with self._lock:
            if self._dead is None:
                batch_id = next(self._ids)
                self._pending[batch_id] = (stream, list(requests))
                self.work.add(requests, self._config.max_model_len or 0)
                self._outbox.put(SubmitRequests(batch_id, tuple(requests), time.monotonic()))
                return stream
        stream._set_admitted(EngineDeadError(f"the engine has stopped: {self._dead!r}"))
        return stream

    def abort(self, request_ids: list[str]) -> None:
        with self._lock:
            if self._dead is None:
                self._outbox.put(AbortRequests(list(request_ids)))

    def set_paused(self, request_ids: list[str], paused: bool) -> None:
        """Flow control from a stream whose reader is behind (or caught up again)."""
        with self._lock:
            if self._dead is None:
                self._outbox.put(PauseRequests(list(request_ids), paused))

    async def call_utility(self, name: str, *args) -> Any:
        """Run `engine.utility.UTILITIES[name](engine, *args)` in the engine between two
        steps."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine has stopped: {self._dead!r}")
            call_id = next(self._ids)
            self._calls[call_id] = (loop, future)
            self._outbox.put(UtilityCall(call_id, name, args))
        return await future

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (Stop, then SIGKILL after `timeout`); open streams get
        EngineDeadError. Returns once the process is gone."""
        with self._lock:
            self._stopping = True
            if self._dead is None:
                self._outbox.put(Stop())
        if self._process is None:
            return
        # Wait on its sentinel, not join(): the receiver thread reaps the process once the
        # pipe closes, and of two threads in waitpid the one that loses sees a live process
        # (ECHILD reads as "not exited"), which would be killed and warned about for nothing.
        if not multiprocessing.connection.wait([self._process.sentinel], timeout):
            logger.warning("the engine process did not stop within %.0fs; killing it", timeout)
            self._process.kill()
        for thread in self._threads:
            thread.join(timeout)
        self._process.join()

    # ---- the connection's threads ----------------------------------------------------
    def _send_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                return  # the process is gone: the receiver reports it

    def _receive_loop(self) -> None:
        failure: str | None = None
        try:
            while True:
                message = self._conn.recv()
                if isinstance(message, EngineFailed):
                    failure = message.message
                else:
                    self._dispatch(message)
        except (EOFError, OSError):
            pass
        except BaseException as exc:
            logger.critical("handling the engine's outputs failed: %r", exc, exc_info=exc)
            failure = f"handling the engine's outputs failed: {exc!r}"
            self._process.kill()
        self._process.join(5.0)
        if self._stopping and failure is None:
            self._die(EngineDeadError("the engine was shut down"), fatal=False)
            return
        reason = failure or f"the engine process exited (exit code {self._process.exitcode})"
        self._die(EngineDeadError(reason), fatal=True)

    def _dispatch(self, message) -> None:
        if isinstance(message, StepBatch):
            self._on_step(message)
        elif isinstance(message, Admitted):
            self._on_admitted(message)
        elif isinstance(message, UtilityResult):
            with self._lock:
                loop, future = self._calls.pop(message.call_id)
            notify(loop, settle, future, message.result, message.error)
        elif isinstance(message, EngineReady):
            self._on_ready(message)
        else:
            raise TypeError(f"unknown message from the engine: {message!r}")

    def _on_ready(self, ready: EngineReady) -> None:
        tokenizer = load_engine_tokenizer(self._config, ready.model_path)
        self.info = EngineInfo(
            served_model_name=ready.served_model_name, max_model_len=ready.max_model_len,
            vocab_size=ready.vocab_size, max_num_seqs=ready.max_num_seqs,
            kv_cache_info=ready.kv_cache_info, tokenizer=tokenizer,
            sampling_defaults=dict(ready.sampling_defaults), quantization=ready.quantization)
        # The receiver thread's own copy: Rust tokenizers are not to be shared across threads.
        self._processor = OutputProcessor(load_engine_tokenizer(self._config, ready.model_path))
        if self._metrics_factory is not None:
            self.metrics = self._metrics_factory(self.info)
        self._publish(ready.snapshot)
        self._ready.set()
        if self.on_ready is not None:
            self.on_ready(self.info)

    def _on_admitted(self, admitted: Admitted) -> None:
        with self._lock:
            stream, requests = self._pending.pop(admitted.batch_id)
        if admitted.error is None:
            for r in requests:
                self._processor.add(r.request_id, r.prompt, r.sampling_params)
                self._streams[r.request_id] = stream
        else:
            self.work.finish(r.request_id for r in requests)
        notify(stream.loop, stream._set_admitted, admitted.error)

    def _on_step(self, batch: StepBatch) -> None:
        step = self._processor.process(batch.outputs)
        self.work.finish(out.request_id for out in batch.outputs if out.finished)
        if step.to_abort:
            self.abort(step.to_abort)
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        for out in step.for_streams:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted: its client is gone
            if out.finished:
                del self._streams[out.request_id]
            deliveries.setdefault(stream.loop, []).append((stream, out))
        for loop, delivery in deliveries.items():
            notify(loop, put_all, delivery)
        self._publish(batch.snapshot)
        if self.metrics is not None:
            self.metrics.record_step(step.for_metrics, batch.snapshot.stats, batch.time)

    def _publish(self, snapshot) -> None:
        self._snapshot = snapshot
        if self.metrics is not None:
            self.metrics.update_gauges(snapshot.stats)

    def _die(self, exc: BaseException, fatal: bool) -> None:
        if fatal:
            logger.critical("%s", exc)
        with self._lock:
            self._dead = exc
            pending, self._pending = list(self._pending.values()), {}
            calls, self._calls = list(self._calls.values()), {}
            self._outbox.put(None)
        self._ready.set()
        if fatal and self.on_fatal is not None:
            try:  # first, so the server is already stopping when clients hear of it
                self.on_fatal(exc)
            except Exception:  # the streams below must still be told
                logger.exception("on_fatal failed")
        error = EngineDeadError(f"the engine has stopped: {exc}")
        for stream, _ in pending:
            notify(stream.loop, stream._set_admitted, error)
        for loop, future in calls:
            notify(loop, settle, future, None, error)
        for stream in {id(s): s for s in self._streams.values()}.values():
            notify(stream.loop, stream._put, error)
        self._streams.clear()


def _process_name(config: EngineConfig) -> str:
    if config.data_parallel_size == 1:
        return "carpool-engine-core"
    return f"carpool-engine-core-{config.data_parallel_rank}"
