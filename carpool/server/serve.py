"""Wire an engine, the app and uvicorn together, and turn an engine death into an exit code.

By default the engine runs in its own process (`engine.core_client`), started
before the port is bound and stopped after uvicorn has drained; with
`--data-parallel-size N`, N such processes behind one client (`engine.dp_client`);
with `--no-engine-process` it runs on a thread of this one (`engine.async_engine`).
Either way /health is 503 until the model is loaded and the KV cache sized.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from typing import TYPE_CHECKING

import uvicorn

from carpool.config import EngineConfig
from carpool.engine.output_stream import EngineInfo
from carpool.server.http_protocol import (
    DEFAULT_BACKLOG,
    connection_cap,
    guarded_protocol,
    quiet_accept_errors,
    raise_open_files_limit,
)
from carpool.utils.cpu_threads import openmp_wait_environment

if TYPE_CHECKING:
    from carpool.server.admission import Admission
    from carpool.server.app import ServerSettings

logger = logging.getLogger("carpool.server")


def describe_kv_cache(info: EngineInfo) -> str:
    kv = info.kv_cache_info
    return (f"KV cache: {kv['num_blocks']} blocks of {kv['block_size']} tokens = "
            f"{kv['num_tokens']} tokens, {kv['bytes']} bytes ({kv['bytes'] / 2**20:.1f} MiB); "
            f"max concurrency at max_model_len {info.max_model_len}: "
            f"{kv['max_concurrency']:.2f} requests")


def serve(config: EngineConfig, settings: ServerSettings, *, host: str, port: int,
          log_level: str = "info") -> int:
    """Run the server until it is stopped (0, also on SIGTERM) or the engine dies (1)."""
    from carpool.metrics import MetricFamilies, ServerMetrics
    from carpool.server.app import build_app
    from carpool.server.lora_adapters import adapter_check

    exit_code = 0
    server: uvicorn.Server | None = None

    def on_ready(info: EngineInfo) -> None:
        replicas = (f"{settings.data_parallel_size} data-parallel replicas, each with its "
                    if settings.data_parallel_size > 1 else "")
        logger.info("model %r loaded; %s%s", info.served_model_name, replicas,
                    describe_kv_cache(info))
        logger.info("serving on http://%s:%d (max_model_len %d, max_num_seqs %d)",
                    host, port, info.max_model_len, info.max_num_seqs)

    def on_fatal(exc: BaseException) -> None:
        nonlocal exit_code
        exit_code = 1
        logger.critical("the engine stopped (%r); shutting the server down", exc)
        if server is not None:
            server.should_exit = True

    if host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        logger.warning("binding %s without --api-key: anyone who can reach this port can use "
                       "the model", host)
    families = MetricFamilies()  # data-parallel replicas share it, each under its engine label
    hooks = dict(metrics_factory=lambda info, engine=None: ServerMetrics.for_engine(
                     info, log_stats=settings.log_stats, engine=engine, families=families),
                 on_ready=on_ready, on_fatal=on_fatal)
    if settings.data_parallel_size > 1 or settings.engine_process:
        _set_engine_openmp_wait(config)
    if settings.data_parallel_size > 1:
        from carpool.engine.dp_client import DataParallelClient
        engine = DataParallelClient(config, settings.data_parallel_size, log_level=log_level,
                                    **hooks)
    elif settings.engine_process:
        from carpool.engine.core_client import EngineProcessClient
        engine = EngineProcessClient(config, log_level=log_level, **hooks)
    else:
        from carpool.engine.async_engine import AsyncEngine
        from carpool.engine.llm_engine import LLMEngine
        engine = AsyncEngine(lambda: LLMEngine.from_config(config), **hooks)
    app = build_app(engine, settings)
    app.state.grammar_limits = config.grammar_limits  # the server's grammar check's
    app.state.lora_adapters.check = adapter_check(config)  # runtime loads' check
    max_connections = connection_cap(settings.max_connections, raise_open_files_limit(),
                                     DEFAULT_BACKLOG)
    server = DrainingServer(
        uvicorn.Config(app, host=host, port=port, log_level=log_level,
                       http=guarded_protocol(settings.http_read_timeout, max_connections,
                                             settings.http_write_timeout,
                                             settings.http_send_buffer),
                       timeout_keep_alive=settings.timeout_keep_alive, backlog=DEFAULT_BACKLOG,
                       timeout_graceful_shutdown=settings.shutdown_timeout + _CANCEL_GRACE_S),
        app.state.admission, settings.shutdown_timeout)
    engine.start()
    try:
        with _signals_end_the_server_only():
            server.run()
    finally:
        app.state.tokenizer_worker.shutdown()
        engine.shutdown()
    return exit_code


def _set_engine_openmp_wait(config: EngineConfig) -> None:
    """The engine processes started from here spin `cpu_omp_spin_count` times at an OpenMP
    barrier before they sleep (libgomp reads this from the environment they inherit). The
    default, ~0.1 ms, bridges one operator to the next; OpenMP's own ~3 ms made a spinning
    thread wait out whole time slices for a descheduled sibling on a small or shared CPU,
    with HTTP running beside the steps (docs/lab/14-the-engine-in-its-own-process.md,
    docs/lab/21-a-short-openmp-spin-for-the-engine.md)."""
    os.environ.update(openmp_wait_environment(config.cpu.omp_spin_count, os.environ))


# After --shutdown-timeout the open streams are ended with an error; uvicorn cancels
# whatever has still not finished this much later.
_CANCEL_GRACE_S = 5.0


class DrainingServer(uvicorn.Server):
    """On shutdown: refuse new requests at once, let in-flight ones finish for
    `shutdown_timeout` seconds, then end the rest with a clear error."""

    def __init__(self, config, admission: Admission, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.admission = admission
        self.shutdown_timeout = shutdown_timeout

    async def startup(self, sockets=None) -> None:
        quiet_accept_errors(asyncio.get_running_loop())
        await super().startup(sockets)

    async def shutdown(self, sockets=None) -> None:
        self.admission.close("it received a shutdown signal")
        logger.info("shutting down: %d response(s) in flight get up to %.1fs to finish",
                    len(self.admission.streams), self.shutdown_timeout)
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self._abort_rest)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _abort_rest(self) -> None:
        num_aborted = self.admission.abort_all(
            f"the server shut down before this request finished (--shutdown-timeout "
            f"{self.shutdown_timeout:g}s)")
        if num_aborted:
            logger.warning("shutdown timeout: aborted %d unfinished response(s)", num_aborted)


@contextlib.contextmanager
def _signals_end_the_server_only():
    """uvicorn re-raises the SIGTERM / SIGINT that stopped it once it is done, which would kill
    the process with that signal; a graceful stop is a normal exit (0), so the re-raised
    signal is swallowed here. Only on the main thread (where signals can be handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handled = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
