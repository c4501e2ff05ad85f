"""The two seams around the engine: `EngineCore`, what a step loop drives (`LLMEngine`,
or a test fake), and `EngineClient`, what the server holds.

The loop thread (or the engine-core process) reads `EngineCore`'s attributes
once the engine is loaded (to build `EngineInfo` / `EngineReady`) and then only
calls its methods, between steps, on that one thread. `EngineClient` is offered
by `core_client.EngineProcessClient` (one engine-core process, the server's
default) and by `async_engine.AsyncEngine` (the engine on a thread of the
HTTP process); `dp_client.DataParallelClient` offers it over several of the former.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from carpool.engine.commands import EngineSnapshot
from carpool.engine.output_stream import EngineInfo, GenerationRequest, OutputStream
from carpool.outputs import EngineStats, StepOutput
from carpool.sampling_params import SamplingParams


class EngineCore(Protocol):
    model_path: str
    served_model_name: str
    max_model_len: int
    tokenizer: Any
    sampling_defaults: dict
    quantization: str | None  # the weights' format and types ("gguf (Q4_K x97, ...)"), or None

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def kv_cache_info(self) -> dict: ...

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: SamplingParams,
                    arrival_time: float | None = None,
                    cache_salt: str | None = None, lora_request=None) -> int: ...

    def abort_request(self, request_ids: str | Iterable[str]) -> None: ...

    def set_paused(self, request_ids: Iterable[str], paused: bool) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[StepOutput]: ...

    def stats(self) -> EngineStats: ...

    def reset_prefix_cache(self) -> int: ...


class EngineClient(Protocol):
    """What the HTTP side may do with an engine, from its event loop (and `start`,
    `wait_ready`, `shutdown` from the main thread)."""

    info: EngineInfo | None  # set once ready
    metrics: Any  # the server's ServerMetrics once ready, fed from the engine's steps
    num_replicas: int  # data-parallel engines behind it (each with info.max_num_seqs seats)

    def start(self) -> None: ...

    def wait_ready(self, timeout: float | None = None) -> bool: ...

    @property
    def is_ready(self) -> bool: ...

    @property
    def dead_error(self) -> BaseException | None: ...

    def snapshot(self) -> EngineSnapshot | None: ...

    def add(self, requests: list[GenerationRequest]) -> OutputStream: ...

    def abort(self, request_ids: list[str]) -> None: ...

    def set_paused(self, request_ids: list[str], paused: bool) -> None: ...

    async def call_utility(self, name: str, *args) -> Any: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...


def close_engine(engine: EngineCore) -> None:
    """Release what the engine started (tensor-parallel ranks), if it has a `close`; a
    failure to is logged, never raised (the caller is on its way out)."""
    close = getattr(engine, "close", None)
    if close is not None:
        try:
            close()
        except Exception:
            logging.getLogger(__name__).exception("closing the engine failed")


class EngineClientBase:
    """The state both engine clients keep the same way: the server's hooks, readiness,
    death, and the latest published stats snapshot (set by their own threads)."""

    num_replicas = 1

    def __init__(self, metrics_factory: Callable[[EngineInfo], Any] | None,
                 on_ready: Callable[[EngineInfo], None] | None,
                 on_fatal: Callable[[BaseException], None] | None) -> None:
        self._metrics_factory = metrics_factory
        self.on_ready = on_ready
        self.on_fatal = on_fatal
        self.metrics: Any = None
        self.info: EngineInfo | None = None
        self._lock = threading.Lock()  # orders "is it dead?" against "queue a command"
        self._snapshot: EngineSnapshot | None = None  # None until the engine is loaded
        self._ready = threading.Event()
        self._dead: BaseException | None = None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded (True) or loading failed / timed out (False)."""
        self._ready.wait(timeout)
        return self.is_ready

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self._dead is None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def snapshot(self) -> EngineSnapshot | None:
        """The engine stats of the latest step or command; None while loading."""
        return self._snapshot
