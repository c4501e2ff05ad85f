"""The FastAPI app: routes, OpenAI error bodies, and the API-key check.

`build_app` takes a started `AsyncEngine` (it may still be loading: /health
says 503 until it is ready) and the server's settings. Nothing here touches
engine state; routes talk to the engine through its command queue and read
its published snapshot.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

import carpool
from carpool.engine.async_engine import AsyncEngine
from carpool.server import chat, completions, meta, tokenize
from carpool.server.errors import APIError, install_error_handlers

# Routes anyone may call without the API key (load balancers probe them).
PUBLIC_PATHS = frozenset({"/health"})


@dataclass(frozen=True)
class ServerSettings:
    """Settings of the HTTP layer (the engine's live in EngineConfig)."""

    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to disable the check)")


class APIKeyMiddleware:
    """Rejects, with a 401 OpenAI error body, any request without `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                         code="invalid_api_key")
        await error.response()(scope, receive, send)


def build_app(engine: AsyncEngine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    app = FastAPI(title="carpool", version=carpool.__version__,
                  description="OpenAI-compatible LLM server built around continuous batching.")
    app.state.engine = engine
    app.state.settings = settings
    install_error_handlers(app)
    for module in (completions, chat, tokenize, meta):
        app.include_router(module.router)
    if settings.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    return app
