"""The engine-core process: scheduler, runner and KV cache, alone in their own interpreter.

`run_engine_core` is the target of the process `EngineProcessClient` spawns.
It loads the engine (`LLMEngine(detokenize=False)`: token ids only, the front
end makes the text), says `EngineReady`, then loops: drain the commands
waiting on the connection (blocking only when nothing runs), run one step,
send its outputs and stats as one `StepBatch`. No Python work of the HTTP
side (tokenizing, chat templates, detokenizing, /metrics) shares this GIL.

It never outlives the front end: a closed connection (the parent exited, even
by SIGKILL, so the kernel closed its end) ends the loop, and while idle it also
checks once a second that its parent is still the one that started it. It runs
in its own process group and ignores SIGINT, so a Ctrl-C or a signal to the
server's group reaches the front end only, which drains first and then sends
`Stop`; a SIGTERM sent to this process itself still ends it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from carpool.config import EngineConfig
from carpool.engine.commands import EngineSnapshot
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
from carpool.engine.protocol import EngineCore, close_engine
from carpool.engine.utility import UTILITIES

logger = logging.getLogger(__name__)

# While idle, how often the process checks that its parent is alive (seconds).
PARENT_CHECK_S = 1.0


class FrontEndGone(Exception):
    """The front end closed the connection or exited: nobody is left to serve."""


def load_engine(config: EngineConfig) -> EngineCore:
    """The engine of this process, which carpool started for it alone: here "auto" pins
    torch's threads (`cpu_threads`)."""
    import dataclasses

    from carpool.engine.llm_engine import LLMEngine
    from carpool.engine.runner_setup import place_replica
    from carpool.utils.cpu_threads import resolve_auto
    cpu = dataclasses.replace(config.cpu,
                              omp_threads_bind=resolve_auto(config.cpu.omp_threads_bind))
    config = dataclasses.replace(config, cpu=cpu)
    return LLMEngine.from_config(place_replica(config), detokenize=False)


def run_engine_core(config: EngineConfig, conn: Connection, log_level: str = "INFO",
                    factory: Callable[[EngineConfig], EngineCore] = load_engine) -> None:
    """The process's whole life; exits 1 after telling the front end why it failed."""
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parent_pid = os.getppid()
    try:
        engine = factory(config)
        conn.send(_ready(engine))
    except BaseException as exc:  # noqa: BLE001 - anything here means no engine
        _fail(conn, "loading the model failed", exc)
    try:
        EngineCoreLoop(engine, conn, parent_pid).run()
    except (FrontEndGone, EOFError, BrokenPipeError, ConnectionResetError):
        logger.info("the front end is gone; the engine process exits")
    except BaseException as exc:  # noqa: BLE001 - the step loop cannot continue
        close_engine(engine)
        _fail(conn, "the engine step loop failed", exc)
    close_engine(engine)


def _ready(engine: EngineCore) -> EngineReady:
    return EngineReady(
        model_path=engine.model_path, served_model_name=engine.served_model_name,
        max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
        max_num_seqs=engine.max_num_seqs, kv_cache_info=engine.kv_cache_info,
        sampling_defaults=dict(engine.sampling_defaults),
        snapshot=EngineSnapshot(engine.stats(), time.monotonic(), 0),
        quantization=engine.quantization)


def _fail(conn: Connection, what: str, exc: BaseException) -> None:
    logger.critical("%s: %r", what, exc, exc_info=exc)
    try:
        conn.send(EngineFailed(f"{what}: {exc!r}"))
    except OSError:
        pass
    sys.exit(1)


class EngineCoreLoop:
    """Commands in, one `StepBatch` out per step; see the module docstring."""

    def __init__(self, engine: EngineCore, conn: Connection, parent_pid: int) -> None:
        self.engine = engine
        self.conn = conn
        self.parent_pid = parent_pid
        self.num_requests_taken = 0
        # Set from another thread when the engine can no longer step (a tensor-parallel rank
        # died); raised by the loop within PARENT_CHECK_S even while idle.
        self.failure: BaseException | None = None
        notify_on_failure = getattr(engine, "notify_on_failure", None)
        if notify_on_failure is not None:
            notify_on_failure(self._on_failure)

    def _on_failure(self, error: BaseException) -> None:
        self.failure = error

    def run(self) -> None:
        engine = self.engine
        while True:
            commands = self._receive(block=not engine.has_unfinished_requests())
            for command in commands:
                if isinstance(command, Stop):
                    return
                self._handle(command)
            if engine.has_unfinished_requests():
                outputs = engine.step()
                self.conn.send(StepBatch(outputs, self._snapshot(), time.monotonic()))
            elif commands:  # aborts freed blocks, or requests were refused: show it
                self.conn.send(StepBatch([], self._snapshot(), time.monotonic()))

    def _receive(self, block: bool) -> list:
        if self.failure is not None:
            raise self.failure
        if block:
            while not self.conn.poll(PARENT_CHECK_S):
                if os.getppid() != self.parent_pid:
                    raise FrontEndGone
                if self.failure is not None:
                    raise self.failure
        commands = []
        while self.conn.poll():
            commands.append(self.conn.recv())
        return commands

    def _handle(self, command) -> None:
        if isinstance(command, SubmitRequests):
            self.conn.send(Admitted(command.batch_id, self._add(command)))
        elif isinstance(command, AbortRequests):
            self.engine.abort_request(command.request_ids)
        elif isinstance(command, PauseRequests):
            self.engine.set_paused(command.request_ids, command.paused)
        elif isinstance(command, UtilityCall):
            try:
                result, error = UTILITIES[command.name](self.engine, *command.args), None
            except Exception as exc:  # noqa: BLE001 - handed back to the caller
                result, error = None, exc
            self.conn.send(UtilityResult(command.call_id, result, error))
        else:
            raise TypeError(f"unknown command {command!r}")

    def _add(self, command: SubmitRequests) -> Exception | None:
        """Add every request or none; the refusal, if any."""
        self.num_requests_taken += len(command.requests)
        added: list[str] = []
        try:
            for r in command.requests:
                self.engine.add_request(r.request_id, r.prompt, r.sampling_params,
                                        arrival_time=command.arrival_time,
                                        cache_salt=r.cache_salt, lora_request=r.lora_request)
                added.append(r.request_id)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            if added:
                self.engine.abort_request(added)
            return exc
        return None

    def _snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(self.engine.stats(), time.monotonic(), self.num_requests_taken)
