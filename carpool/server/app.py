"""The FastAPI app: routes, OpenAI error bodies, and the API-key check.

`build_app` takes a started engine client (`engine.protocol.EngineClient`: the
engine-core process's, or the in-process `AsyncEngine`; it may still be loading: /health
says 503 until it is ready) and the server's settings. Nothing here touches
engine state; routes talk to the engine through its command queue and read
its published snapshot.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

import carpool
from carpool.engine.protocol import EngineClient
from carpool.lora_request import LoRARequest
from carpool.server import chat, completions, lora_adapters, meta, responses, tokenize
from carpool.server.admission import Admission
from carpool.server.body_limit import BodyLimitMiddleware
from carpool.server.errors import APIError, install_error_handlers
from carpool.server.http_protocol import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_READ_TIMEOUT_S,
    DEFAULT_SEND_BUFFER_BYTES,
    DEFAULT_WRITE_TIMEOUT_S,
)
from carpool.server.logprobs import DEFAULT_MAX_LOGPROB_WORK
from carpool.server.openapi import openapi_document
from carpool.server.prompts import DEFAULT_MAX_TOKENIZER_QUEUE, TokenizerWorker
from carpool.server.tool_parsers import get_parser

# The modules whose `router` build_app includes.
ROUTE_MODULES = (completions, chat, responses, tokenize, meta, lora_adapters)
# The API key guards the OpenAI routes and those that cost work or change or reveal the
# server's state; /metrics, the probes (/health, /ping, /load, /version) and SGLang's
# router routes stay open, as in vLLM (Prometheus and load balancers send no key).
PROTECTED_PREFIX = "/v1/"
PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize", "/stats", "/reset_prefix_cache",
                             "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 2**20
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5.0  # uvicorn's
DEFAULT_MAX_STREAM_BACKLOG = 2048  # outputs a streamed response's reader may leave unread
DEFAULT_STREAM_PAUSE_BACKLOG = 32  # unread outputs at which a stream's requests pause
# An engine with work that has finished no step for this long is reported stalled (/health
# 503): far beyond any one step, well within a router's patience.
DEFAULT_ENGINE_STALL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ServerSettings:
    """Settings of the HTTP layer (the engine's live in EngineConfig)."""

    api_key: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_num_waiting_requests: int | None = None  # None: 4 x max_num_seqs
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    log_prompts: bool = False
    http_read_timeout: float = DEFAULT_READ_TIMEOUT_S
    http_write_timeout: float = DEFAULT_WRITE_TIMEOUT_S
    max_stream_backlog: int = DEFAULT_MAX_STREAM_BACKLOG
    # Flow control: unread outputs (at least one step's worth) at which a stream's requests
    # are paused until its reader catches up; 0: never paused.
    stream_pause_backlog: int = DEFAULT_STREAM_PAUSE_BACKLOG
    # SO_SNDBUF of each client socket in bytes (0: the kernel's, which grows to megabytes),
    # so that a client that stops reading is noticed after this much, not megabytes, of output.
    http_send_buffer: int = DEFAULT_SEND_BUFFER_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S
    log_requests: bool = False  # one log line per request (vLLM's --enable-log-requests)
    log_stats: bool = True  # the periodic throughput line (off: vLLM's --disable-log-stats)
    # tool_choice "auto": read the model's own calls back with this parser (vLLM's flags)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # Run the engine in its own process (the default) rather than on a thread of this one.
    engine_process: bool = True
    # Engine replicas behind this front end, each its own process (vLLM's -dp).
    data_parallel_size: int = 1
    # Tokenizer jobs queued or running per lane (generation prompts, /tokenize) before 503s.
    max_tokenizer_queue: int = DEFAULT_MAX_TOKENIZER_QUEUE
    # Logprob entries (tokens x (top-N + 1), over prompts and choices) one request may ask for.
    max_logprob_work: int = DEFAULT_MAX_LOGPROB_WORK
    # Seconds an engine with work may go without finishing a step before /health is 503
    # (0: never reported stalled).
    engine_stall_timeout: float = DEFAULT_ENGINE_STALL_TIMEOUT_S
    # LoRA adapters served by name from the start (`--lora-modules`), and whether
    # /v1/load_lora_adapter and /v1/unload_lora_adapter may change them (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING, a flag here).
    lora_modules: tuple[LoRARequest, ...] = ()
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to disable the check)")
        if isinstance(self.max_request_body_bytes, bool) or self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, "
                             f"got {self.max_request_body_bytes!r}")
        if self.max_num_waiting_requests is not None and self.max_num_waiting_requests < 1:
            raise ValueError(f"max_num_waiting_requests must be >= 1, "
                             f"got {self.max_num_waiting_requests!r}")
        if self.tool_call_parser is not None:
            get_parser(self.tool_call_parser)  # ValueError naming tool_call_parser
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("tool_call_parser must be set with enable_auto_tool_choice")
        if not 0 <= self.shutdown_timeout < float("inf"):
            raise ValueError(f"shutdown_timeout must be a finite number of seconds >= 0, "
                             f"got {self.shutdown_timeout!r}")
        for name in ("http_read_timeout", "http_write_timeout", "timeout_keep_alive"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        if isinstance(self.max_stream_backlog, bool) or self.max_stream_backlog < 1:
            raise ValueError(f"max_stream_backlog must be >= 1, got {self.max_stream_backlog!r}")
        for name in ("stream_pause_backlog", "http_send_buffer"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("max_tokenizer_queue", "max_logprob_work"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0 <= self.engine_stall_timeout < float("inf"):
            raise ValueError(f"engine_stall_timeout must be a finite number of seconds >= 0, "
                             f"got {self.engine_stall_timeout!r}")
        if isinstance(self.max_connections, bool) or self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections!r}")
        if isinstance(self.data_parallel_size, bool) or self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size!r}")
        if self.data_parallel_size > 1 and not self.engine_process:
            raise ValueError(f"data_parallel_size (--data-parallel-size) "
                             f"{self.data_parallel_size} runs each replica in its own process: "
                             "it cannot be combined with --no-engine-process")


class APIKeyMiddleware:
    """Rejects, with a 401 OpenAI error body, any request without exactly one
    `Authorization: Bearer <key>` header (the scheme in any case, as RFC 7235 allows)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = _digest(api_key.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        given = _bearer_token(scope["headers"])
        # Digests first, so the comparison takes the same time whatever the length sent.
        if given is not None and hmac.compare_digest(_digest(given), self._expected):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "Missing or invalid API key: send one 'Authorization: Bearer <key>' "
                         "header.", code="invalid_api_key")
        await error.response()(scope, receive, send)


def is_protected(path: str) -> bool:
    """Whether `path` needs the API key: everything under /v1/ (and /v1 itself), and
    `PROTECTED_PATHS`."""
    return (path == PROTECTED_PREFIX.rstrip("/") or path.startswith(PROTECTED_PREFIX)
            or path.rstrip("/") in PROTECTED_PATHS)


def _bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the request's one `Authorization: Bearer` header; None if there is no such
    header, or more than one (which one a proxy or framework would read is anyone's guess)."""
    values = [value for name, value in headers if name == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _, token = values[0].partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.lstrip(b" ")


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def build_app(engine: EngineClient, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    app = FastAPI(title="carpool", version=carpool.__version__,
                  description="OpenAI-compatible LLM server built around continuous batching.")
    app.state.engine = engine
    app.state.settings = settings
    app.state.admission = Admission(settings.max_num_waiting_requests)
    app.state.tokenizer_worker = TokenizerWorker(settings.max_tokenizer_queue)
    # (checked against the model by `serve`, which sets the check runtime loads take)
    app.state.lora_adapters = lora_adapters.ServedAdapters(
        settings.lora_modules, allow_updates=settings.allow_runtime_lora_updating)
    install_error_handlers(app)
    for module in ROUTE_MODULES:
        app.include_router(module.router)
    app.openapi = lambda: openapi_document(app, is_protected)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    if settings.api_key is not None:  # added last: runs first, before any body is read
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    return app
