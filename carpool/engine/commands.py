"""The messages between the HTTP side and the engine's loop thread, as frozen dataclasses.

Commands go in through `AsyncEngine`'s queue and are handled between two steps;
`EngineSnapshot` comes out after every step (and after commands), for /stats,
/metrics and admission.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from carpool.engine.output_stream import GenerationRequest
from carpool.outputs import EngineStats

if TYPE_CHECKING:
    from carpool.engine.output_stream import OutputStream


@dataclass(frozen=True)
class AddRequests:
    """Admit these requests together (all or none); their deltas go to `stream`."""

    requests: list[GenerationRequest]
    stream: OutputStream
    arrival_time: float  # time.monotonic() when the HTTP side queued them


@dataclass(frozen=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True)
class PauseRequests:
    """Flow control: hold these requests back (`paused`), or let them run again."""

    request_ids: list[str]
    paused: bool


@dataclass(frozen=True)
class CallEngine:
    """Run `fn(engine)` on the loop thread; its result or exception settles `future`."""

    fn: Callable[[Any], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True)
class Stop:
    """End the step loop; with an `error`, as a failure (the engine can no longer step)."""

    error: BaseException | None = None


Command = AddRequests | AbortRequests | PauseRequests | CallEngine | Stop


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's stats as published by the loop thread, with when and how many requests it
    had taken in by then (see `server.admission`)."""

    stats: EngineStats
    time: float  # time.monotonic()
    num_requests_taken: int

    def as_dict(self) -> dict:
        return {**self.stats.as_dict(), "time": self.time,
                "num_requests_taken": self.num_requests_taken}
