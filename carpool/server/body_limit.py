"""Reject request bodies over `--max-request-body-bytes` before anything parses them.

A body that declares a larger `Content-Length` is refused without reading it;
one sent without a length (chunked) is counted as it arrives and refused the
moment it passes the limit, so at most `max_bytes` of it is ever held. A body
within the limit is handed to the app as one message, followed by whatever
the client sends next (a disconnect), so disconnect detection still works.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from carpool.server.errors import APIError


class BodyLimitMiddleware:
    """413 with OpenAI's error body for a body over `max_bytes`; see the module docstring."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._reject(scope, receive, send, declared.decode("latin-1"))
            return
        chunks: list[bytes] = []
        num_bytes = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            num_bytes += len(chunks[-1])
            if num_bytes > self.max_bytes:
                await self._reject(scope, receive, send, f"more than {num_bytes}")
                return
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        error = APIError(413, f"The request body ({size} bytes) is larger than this server "
                         f"accepts ({self.max_bytes} bytes, --max-request-body-bytes).",
                         code="request_too_large", headers={"Connection": "close"})
        await error.response()(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A `receive` that returns `messages` first, then defers to the real one."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
