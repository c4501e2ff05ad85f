"""Half-open connections (issue 21, item 1): a client that connects and never finishes its
request is closed after --http-read-timeout, and a flood of them beyond --max-connections
neither locks out /health nor stalls a stream in progress. A client that stops reading its
stream (item 7) is cut off after --http-write-timeout and its requests aborted."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest

from tests.reliability.live import API_KEY, MODEL, live_server, wait_idle_and_intact
from tests.server.live import metric_value

pytestmark = pytest.mark.slow  # a live server (still run in CI)

READ_TIMEOUT_S = 2.0
WRITE_TIMEOUT_S = 0.5
MAX_CONNECTIONS = 40
FLAGS = ["--http-read-timeout", str(READ_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
         "--http-write-timeout", str(WRITE_TIMEOUT_S),
         # 8 choices of 2000 tokens take 2000 steps, while an unread stream fills its
         # socket's buffers within the first ~100
         "--max-model-len", "2048", "--num-kv-blocks", "1024", "--max-num-seqs", "8"]

PARTIAL_HEADERS = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
PARTIAL_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                + API_KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                b"Content-Length: 4000000\r\n\r\n" + b'{"prompt": "aaaaaaaa')
NOTHING = b""


@pytest.fixture(scope="module")
def guarded_server(llama_checkpoint, tmp_path_factory):
    with live_server(llama_checkpoint, FLAGS,
                     tmp_path_factory.mktemp("slow") / "server.log") as live:
        yield live


def _address(live) -> tuple[str, int]:
    url = urlsplit(live.base_url)
    return url.hostname, url.port


def _open(address, payload: bytes) -> socket.socket:
    sock = socket.create_connection(address, timeout=5)
    if payload:
        sock.sendall(payload)
    return sock


def _seconds_until_closed(sock: socket.socket, limit: float) -> float:
    """How long until the server closes `sock` (EOF or reset); `limit` + 1 if it never does."""
    start = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - start < limit:
        try:
            if sock.recv(4096) == b"":
                break
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
    else:
        return limit + 1
    return time.monotonic() - start


def _victim(live) -> tuple[float, float]:
    """One greedy streamed completion: (total seconds, largest gap between events)."""
    start = last = time.monotonic()
    largest = 0.0
    with live.http() as http, http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": "def f(x):", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                now = time.monotonic()
                largest, last = max(largest, now - last), now
    return last - start, largest


@pytest.mark.parametrize("payload", [PARTIAL_HEADERS, PARTIAL_BODY, NOTHING],
                         ids=["partial-headers", "partial-body", "nothing"])
def test_a_connection_that_never_finishes_its_request_is_closed(guarded_server, payload):
    socks = [_open(_address(guarded_server), payload) for _ in range(5)]
    try:
        waited = [_seconds_until_closed(s, READ_TIMEOUT_S + 5) for s in socks]
    finally:
        for s in socks:
            s.close()
    assert max(waited) <= READ_TIMEOUT_S + 3, waited
    wait_idle_and_intact(guarded_server)


def test_a_slow_but_timely_request_is_served(guarded_server):
    body = b'{"model": "%s", "prompt": "x", "max_tokens": 2}' % MODEL.encode()
    with _open(_address(guarded_server), (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + API_KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n")) as sock:
        time.sleep(READ_TIMEOUT_S / 2)
        sock.sendall(body)
        sock.settimeout(30)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")


def test_a_flood_beyond_the_cap_locks_out_neither_health_nor_streams(guarded_server):
    address = _address(guarded_server)
    flood = [_open(address, PARTIAL_HEADERS) for _ in range(3 * MAX_CONNECTIONS)]
    try:
        with guarded_server.http() as http:
            start = time.monotonic()
            assert http.get("/health").status_code == 200
            assert time.monotonic() - start < 1.0
        flood += [_open(address, PARTIAL_HEADERS) for _ in range(MAX_CONNECTIONS)]
        total, largest_gap = _victim(guarded_server)
        assert largest_gap < 1.0, largest_gap
        # The oldest half-open sockets were evicted to make room.
        assert _seconds_until_closed(flood[0], 1.0) <= 1.0
    finally:
        for s in flood:
            s.close()
    assert "evicted" in guarded_server.log()
    wait_idle_and_intact(guarded_server)


def _cut_off_non_reader(live) -> None:
    """8 streamed choices of 2000 tokens with logprobs (~10 MB: more than loopback's socket
    buffers hold; 2000 steps), read by nobody: all 8 must end as aborts, none by running
    out its tokens."""
    body = json.dumps({"model": MODEL, "prompt": "def f(x):", "n": 8, "max_tokens": 2000,
                       "logprobs": 5, "temperature": 1.0, "ignore_eos": True,
                       "stream": True}).encode()

    def finished(reason: str) -> float:
        with live.http() as http:
            return metric_value(http.get("/metrics").text, "carpool:request_success_total",
                                finished_reason=reason)

    aborted_before, length_before = finished("abort"), finished("length")
    with live.http() as http:
        taken_before = http.get("/stats").json()["num_requests_taken"]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills after a few chunks
    sock.connect(_address(live))
    start = time.monotonic()
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     + API_KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        with live.http() as http:  # the engine has taken them in
            while http.get("/stats").json()["num_requests_taken"] < taken_before + 8:
                assert time.monotonic() - start < 60
                time.sleep(0.05)
        wait_idle_and_intact(live, timeout=60)  # never reading: never waits on us
        elapsed = time.monotonic() - start
    finally:
        sock.close()
    assert finished("abort") - aborted_before == 8, elapsed
    assert finished("length") == length_before


def test_a_client_that_stops_reading_its_stream_is_cut_off_and_its_requests_freed(
        guarded_server):
    """By --http-write-timeout (the backlog limit is far above what 8 choices queue here)."""
    _cut_off_non_reader(guarded_server)


def test_a_stream_whose_reader_falls_too_far_behind_is_ended(llama_checkpoint,
                                                             tmp_path_factory):
    """By --max-stream-backlog, long before the write timeout would (with flow control off:
    paused requests would send no more outputs to fall behind by)."""
    flags = [*FLAGS, "--http-write-timeout", "1000", "--max-stream-backlog", "64",
             "--stream-pause-backlog", "0"]
    with live_server(llama_checkpoint, flags,
                     tmp_path_factory.mktemp("backlog") / "server.log") as live:
        _cut_off_non_reader(live)
        # a client that reads keeps its stream whatever its size
        with live.http() as http:
            response = http.post("/v1/completions", json={
                "model": MODEL, "prompt": "x", "n": 8, "max_tokens": 64, "ignore_eos": True,
                "stream": True})
        assert response.status_code == 200 and "stream_backlog" not in response.text
        assert response.text.count('"finish_reason":"length"') == 8
