"""Wire an engine, the app and uvicorn together, and turn an engine death into an exit code."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from carpool.config import EngineConfig
from carpool.engine.async_engine import AsyncEngine, EngineInfo

if TYPE_CHECKING:
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
    """Run the server until it is stopped (0) or the engine dies (1)."""
    import uvicorn

    from carpool.engine.llm_engine import LLMEngine
    from carpool.metrics import ServerMetrics
    from carpool.server.app import build_app

    exit_code = 0
    server: uvicorn.Server | None = None

    def on_ready(info: EngineInfo) -> None:
        logger.info("model %r loaded; %s", info.served_model_name, describe_kv_cache(info))
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
    engine = AsyncEngine(lambda: LLMEngine.from_config(config),
                         metrics_factory=lambda info: ServerMetrics(info.served_model_name),
                         on_ready=on_ready, on_fatal=on_fatal)
    app = build_app(engine, settings)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    engine.start()
    try:
        server.run()
    finally:
        engine.shutdown()
    return exit_code
