"""uvicorn's h11 protocol with two guards against clients that connect and never finish asking.

Left alone, a connection that sends half a request line, half its headers, a
`Content-Length` and then a trickle of body, or nothing at all, is kept open
forever; a few thousand of them exhaust the file descriptors, after which
nothing (not even /health) is accepted and asyncio logs a traceback for every
failed accept. So:

- **Read deadline.** A connection must deliver a whole request, headers and
  body, within `read_timeout` seconds of connecting (or of the previous
  response ending, for keep-alive); otherwise it is closed. Once a request is
  complete its response may take as long as it needs (streams do).
- **Write deadline.** A client that stops reading while its response is being
  sent (the socket's buffers fill and asyncio pauses writing) for `write_timeout`
  seconds in a row is disconnected; its stream ends like any disconnect, so its
  engine requests are aborted and their KV blocks and queued outputs freed.
  A slow reader that keeps reading is never cut off: each resume resets the clock.
- **Send buffer.** Each client socket's SO_SNDBUF, and asyncio's write
  buffer high-water mark, are set to `send_buffer` bytes: left to itself the
  kernel grows its buffer to megabytes, which a client that
  stopped reading fills for many seconds before the server can notice (and
  pause its requests, see `OutputStream`).
- **Connection cap.** At most `max_connections` are open. A new connection
  over the cap evicts the oldest one that has still not delivered a whole
  request (that is where a slowloris flood sits); only if every open
  connection is a real request in progress is the new one refused. So probes
  and new clients keep getting in while an attacker holds half-open sockets.

Closures are counted and logged once per interval, never once per socket.
"""

from __future__ import annotations

import logging
import resource
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("carpool.server")

DEFAULT_READ_TIMEOUT_S = 20.0
DEFAULT_WRITE_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_SEND_BUFFER_BYTES = 32 * 1024
# File descriptors kept for everything but client sockets (model files, logs, pipes).
_RESERVED_FDS = 64
_LOG_INTERVAL_S = 10.0
_REQUEST_DELIVERED = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR)


@dataclass
class ConnectionGuard:
    """The state the guarded protocols of one server share (the event loop's thread only)."""

    read_timeout: float
    max_connections: int
    write_timeout: float = DEFAULT_WRITE_TIMEOUT_S
    send_buffer: int = DEFAULT_SEND_BUFFER_BYTES  # 0: the kernel's
    # Connections still waiting for a whole request, oldest first.
    pending: OrderedDict = None  # type: ignore[assignment]
    num_timed_out: int = 0
    num_stalled: int = 0
    num_evicted: int = 0
    num_refused: int = 0
    _logged_at: float = 0.0

    def __post_init__(self) -> None:
        self.pending = OrderedDict()

    def note_closed(self) -> None:
        now = time.monotonic()
        if now - self._logged_at < _LOG_INTERVAL_S:
            return
        self._logged_at = now
        logger.warning(
            "slow or idle clients: %d connection(s) closed for not sending a whole request "
            "within %gs, %d for not reading their response for %gs, %d evicted and %d "
            "refused at --max-connections %d (totals so far)",
            self.num_timed_out, self.read_timeout, self.num_stalled, self.write_timeout,
            self.num_evicted, self.num_refused, self.max_connections)


def guarded_protocol(read_timeout: float, max_connections: int,
                     write_timeout: float = DEFAULT_WRITE_TIMEOUT_S,
                     send_buffer: int = DEFAULT_SEND_BUFFER_BYTES) -> type[H11Protocol]:
    """An H11Protocol subclass sharing one `ConnectionGuard` (pass it as uvicorn's `http`)."""
    guard = ConnectionGuard(read_timeout, max_connections, write_timeout, send_buffer)

    class GuardedH11Protocol(_GuardedH11Protocol):
        pass

    GuardedH11Protocol.guard = guard
    return GuardedH11Protocol


class _GuardedH11Protocol(H11Protocol):
    guard: ConnectionGuard

    def connection_made(self, transport) -> None:  # type: ignore[override]
        guard = self.guard
        if len(self.connections) >= guard.max_connections and not self._evict_oldest_pending():
            guard.num_refused += 1
            guard.note_closed()
            self.transport = transport  # connection_lost (after the abort) closes it again
            transport.abort()
            return
        self._deadline = None
        self._write_deadline = None
        if guard.send_buffer:
            self._limit_send_buffers(transport, guard.send_buffer)
        super().connection_made(transport)
        self._await_request()

    @staticmethod
    def _limit_send_buffers(transport, size: int) -> None:
        """The kernel's send buffer and asyncio's (whose high-water mark pauses writing) at
        `size` bytes each: a client that stops reading is noticed after ~3x `size` of output."""
        transport.set_write_buffer_limits(high=size)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
            except OSError:
                pass  # not a socket that has one: the kernel's default

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in _REQUEST_DELIVERED:
            self._request_delivered()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.conn.their_state in _REQUEST_DELIVERED:  # a pipelined request already in
            self._request_delivered()
        else:
            self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._request_delivered()
        self._writing_resumed()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if getattr(self, "_write_deadline", None) is None:
            self._write_deadline = self.loop.call_later(self.guard.write_timeout,
                                                        self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._writing_resumed()

    def _writing_resumed(self) -> None:
        deadline = getattr(self, "_write_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._write_deadline = None

    def _write_timed_out(self) -> None:
        self._write_deadline = None
        self.guard.num_stalled += 1
        self.guard.note_closed()
        self._close()

    # ---- deadline and eviction ---------------------------------------------
    def _await_request(self) -> None:
        self._request_delivered()
        self._deadline = self.loop.call_later(self.guard.read_timeout, self._read_timed_out)
        self.guard.pending[self] = None

    def _request_delivered(self) -> None:
        deadline = getattr(self, "_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._deadline = None
        self.guard.pending.pop(self, None)

    def _read_timed_out(self) -> None:
        self._deadline = None
        self.guard.num_timed_out += 1
        self.guard.note_closed()
        self._close()

    def _evict_oldest_pending(self) -> bool:
        if not self.guard.pending:
            return False
        oldest = next(iter(self.guard.pending))
        self.guard.num_evicted += 1
        self.guard.note_closed()
        oldest._close()
        return True

    def _close(self) -> None:
        self._request_delivered()
        self.connections.discard(self)  # the slot is free now, not when the loop gets to it
        self.transport.abort()


def raise_open_files_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (as vLLM does); returns the
    soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(max_connections: int, open_files_limit: int) -> int:
    """`max_connections`, lowered so that client sockets can never use up the descriptors."""
    return max(1, min(max_connections, open_files_limit - _RESERVED_FDS))
