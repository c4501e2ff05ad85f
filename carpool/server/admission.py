"""Who may enter the engine's queue, and ending what is still in flight when the server stops.

The waiting queue is bounded: a request that would push the engine's waiting
requests past `max_num_waiting_requests` gets a 503 with `Retry-After` at
once, instead of piling up memory and latency for everyone. The count is the
engine's published `num_waiting` plus the requests sent to the engine that
its snapshot has not taken in yet (`num_sent` minus the snapshot's
`num_requests_taken`, two running totals): nothing is missed or counted
twice, and the only lag — requests scheduled since the snapshot still count
as waiting for up to one step — errs towards refusing.

On shutdown, `close()` turns new requests away and `abort_all()` ends the
streams still open with a clear error (and aborts their engine requests).
"""

from __future__ import annotations

import time
from collections import deque

from carpool.engine.output_stream import GenerationRequest, OutputStream, ServerClosingError
from carpool.engine.protocol import EngineClient
from carpool.server.errors import APIError

# With no --max-num-waiting-requests, the queue holds this many times max_num_seqs.
DEFAULT_WAITING_PER_SEAT = 4
RETRY_AFTER_S = 1


class Admission:
    """The bounded queue's gate and the set of open streams; event-loop side only."""

    def __init__(self, max_num_waiting_requests: int | None = None) -> None:
        self._max_num_waiting = max_num_waiting_requests
        self.num_sent = 0  # engine requests ever sent for admission
        # (num_sent after a send, its time.monotonic()) of the sends the engine's snapshot may
        # not have taken in yet, oldest first (`oldest_untaken_send`).
        self._sends: deque[tuple[int, float]] = deque()
        self.streams: set[OutputStream] = set()
        self.closing_reason: str | None = None

    def limit(self, engine: EngineClient) -> int:
        """The most engine requests that may wait: the flag's, or 4 x every replica's seats."""
        if self._max_num_waiting is not None:
            return self._max_num_waiting
        return DEFAULT_WAITING_PER_SEAT * engine.info.max_num_seqs * engine.num_replicas

    def check(self, engine: EngineClient, num_requests: int) -> None:
        """Raise the APIError that turns these requests away, if any."""
        if self.closing_reason is not None:
            raise APIError(503, f"The server is shutting down ({self.closing_reason}); "
                           "send the request to another replica.", code="server_shutting_down")
        limit = self.limit(engine)
        if num_requests > limit:
            raise APIError(400, f"n x number of prompts = {num_requests} generations, more than "
                           f"the server's whole waiting queue holds ({limit}); split the request",
                           param="n")
        snapshot = engine.snapshot()
        num_waiting = self.num_sent
        if snapshot is not None:
            num_waiting += snapshot.stats.num_waiting - snapshot.num_requests_taken
        if num_waiting + num_requests > limit:
            raise APIError(503, f"The server is overloaded: {num_waiting} requests are waiting "
                           f"(limit {limit}); retry after {RETRY_AFTER_S}s.",
                           code="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})

    async def start(self, engine: EngineClient, requests: list[GenerationRequest]) -> OutputStream:
        """Queue the requests and wait for admission; the engine's refusal is raised as is."""
        self.check(engine, len(requests))
        stream = engine.add(requests)
        self.num_sent += len(requests)
        self._sends.append((self.num_sent, time.monotonic()))
        try:
            await stream.admitted()
        except BaseException:
            stream.close()  # nothing to abort if refused; a cancelled wait must not leak
            raise
        self.streams.add(stream)
        return stream

    def oldest_untaken_send(self, num_requests_taken: int) -> float | None:
        """When the oldest send the engine had not taken in by `num_requests_taken` (its
        snapshot's running total) was made; None if it has taken them all."""
        while self._sends and self._sends[0][0] <= num_requests_taken:
            self._sends.popleft()
        return self._sends[0][1] if self._sends else None

    def release(self, stream: OutputStream) -> None:
        """The stream's response has ended: abort what is unfinished, stop tracking it."""
        stream.close()
        self.streams.discard(stream)

    def close(self, reason: str) -> None:
        """Turn every new request away from now on."""
        self.closing_reason = reason

    def abort_all(self, message: str) -> int:
        """End every open stream with `message` as its error; returns how many were open."""
        streams, self.streams = list(self.streams), set()
        for stream in streams:
            stream.fail(ServerClosingError(message))
        return len(streams)
