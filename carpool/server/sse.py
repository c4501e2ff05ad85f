"""Server-sent events as OpenAI streams them, and a response that always cleans up.

Each event is one line `data: {json}` and a blank line; the stream ends with
`data: [DONE]`. `EventStreamResponse` runs its `on_close` callback however the
response ends (finished, client gone before or during the stream, server
shutting down), which is how a disconnected client's requests get aborted even
when its generator never started.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response that calls `on_close()` when it ends, in every case."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
