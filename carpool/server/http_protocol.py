"""uvicorn's h11 protocol with two guards against clients that connect and never finish asking.

Left alone, a connection that sends half a request line, half its headers, a
`Content-Length` and then a trickle of body, or nothing at all, is kept open
forever; a few thousand of them exhaust the file descriptors, after which
nothing (not even /health) is accepted and asyncio logs a traceback for every
failed accept. So:

- **Read deadline.** A connection must deliver a whole request, headers and
  body, within `read_timeout` seconds of connecting (or, for keep-alive, of its
  previous response having left asyncio's buffer: a big reply read slowly is
  still being sent, not idle); otherwise it is closed, gracefully (what the
  kernel still holds of a reply goes out before the FIN). Once a request is
  complete its response may take as long as it needs (streams do).
- **Write deadline.** A client that stops reading while its response is being
  sent (the socket's buffers fill and asyncio pauses writing) for `write_timeout`
  seconds in a row is disconnected; its stream ends like any disconnect, so its
  engine requests are aborted and their KV blocks and queued outputs freed.
  A slow reader that keeps reading is never cut off: each resume, or any progress
  through the buffer within the timeout, resets the clock.
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

Closures are counted and logged once per interval, never once per socket; so are the
accept errors asyncio reports when the descriptors run out (`quiet_accept_errors`), and
the cap keeps one accept burst (the listen backlog) of descriptors in reserve, since
asyncio accepts up to that many sockets before any of them is refused here.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("carpool.server")

DEFAULT_READ_TIMEOUT_S = 20.0
DEFAULT_WRITE_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_SEND_BUFFER_BYTES = 32 * 1024
# File descriptors kept for everything but client sockets (model files, logs, pipes).
_RESERVED_FDS = 64
# The listen backlog, which is also how many sockets asyncio accepts in one go on the event
# loop: a flood of connections costs every stream one burst's worth of accepting (about 0.8 s
# at uvicorn's 2048, docs/lab/52), so it is nginx's size instead.
DEFAULT_BACKLOG = 512
_LOG_INTERVAL_S = 10.0
# How often a connection whose reply is still in asyncio's buffer looks again before its
# keep-alive read deadline starts.
_SENT_POLL_S = 0.25
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
            self._arm_write_deadline()

    def _arm_write_deadline(self) -> None:
        self._unsent_at_arming = self.transport.get_write_buffer_size()
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
        if self.transport.get_write_buffer_size() < self._unsent_at_arming:
            # Still paused, but the client has read since: one big write drains without a
            # resume, and a reader that keeps reading is never cut off.
            self._arm_write_deadline()
            return
        self.guard.num_stalled += 1
        self.guard.note_closed()
        self._close()

    # ---- deadline and eviction ---------------------------------------------
    def _await_request(self) -> None:
        """Start the read deadline once the previous reply, if any, has been handed to the
        kernel: until then the connection is busy sending, neither idle nor evictable."""
        self._request_delivered()
        if self.transport.get_write_buffer_size():
            self._deadline = self.loop.call_later(_SENT_POLL_S, self._await_request)
            return
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
        self._close(graceful=True)

    def _evict_oldest_pending(self) -> bool:
        if not self.guard.pending:
            return False
        oldest = next(iter(self.guard.pending))
        self.guard.num_evicted += 1
        self.guard.note_closed()
        oldest._close(graceful=True)
        return True

    def _close(self, graceful: bool = False) -> None:
        """Close at once; `graceful`: a connection with nothing left in asyncio's buffer (a
        pending one) closes with a FIN after what the kernel holds, not a reset that drops it.
        A client that stopped reading is reset: its buffer would never drain."""
        self._request_delivered()
        self.connections.discard(self)  # the slot is free now, not when the loop gets to it
        if graceful and not self.transport.get_write_buffer_size():
            self.transport.close()
        else:
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


def connection_cap(max_connections: int, open_files_limit: int,
                   backlog: int = DEFAULT_BACKLOG) -> int:
    """`max_connections`, lowered so that client sockets can never use up the descriptors:
    one accept burst (`backlog` sockets, accepted before any is refused) plus the server's
    own files stay free."""
    return max(1, min(max_connections, open_files_limit - _RESERVED_FDS - backlog))


_ACCEPT_ERROR = "socket.accept() out of system resource"


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Log asyncio's "out of system resource" accept errors (EMFILE and its kin) once per
    interval with their count, instead of a traceback each (tens of thousands a second in
    a connection flood under a low descriptor limit); other errors go on as before."""
    previous = loop.get_exception_handler()
    count = 0
    logged_at = float("-inf")

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        nonlocal count, logged_at
        if context.get("message") != _ACCEPT_ERROR:
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        count += 1
        now = time.monotonic()
        if now - logged_at >= _LOG_INTERVAL_S:
            logged_at = now
            logger.warning("out of file descriptors: %d connection(s) could not be accepted "
                           "(%s; totals so far; raise `ulimit -n` or lower --max-connections)",
                           count, context.get("exception"))

    loop.set_exception_handler(handler)
