"""Flow control (issue 21, item 7): a client that stops reading its stream has its requests
paused in the engine - their seats go to other clients at once, long before any timeout
would end them - and a client that reads again gets the rest of its stream, whole."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from urllib.parse import urlsplit

import h11
import pytest

from tests.reliability.live import (API_KEY, MODEL, live_server, wait_idle_and_intact,
                                    watching_stats)
from tests.server.live import metric_value

pytestmark = pytest.mark.slow  # a live server (still run in CI)

# 8 seats; nobody is cut off for not reading (the write timeout and backlog are far away)
FLAGS = ["--max-num-seqs", "8", "--max-model-len", "2048", "--num-kv-blocks", "1024",
         "--http-write-timeout", "1000", "--max-stream-backlog", "100000"]


@pytest.fixture(scope="module", params=[[], ["--no-engine-process"]],
                ids=["engine-process", "engine-thread"])
def flow_server(request, llama_checkpoint, tmp_path_factory):
    with live_server(llama_checkpoint, FLAGS + request.param,
                     tmp_path_factory.mktemp("flow") / "server.log") as live:
        yield live


def _stats(live) -> dict:
    with live.http() as http:
        return http.get("/stats").json()


def _wait_paused(live, count: int, timeout: float = 60.0) -> None:
    start = time.monotonic()
    while _stats(live)["num_paused"] < count:
        assert time.monotonic() - start < timeout, _stats(live)
        time.sleep(0.05)


def _send_unread(live, body: dict) -> socket.socket:
    """POST a streamed completion on a raw socket whose receive buffer is tiny, and read
    nothing: after a few kilobytes the server's writes block."""
    url = urlsplit(live.base_url)
    payload = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((url.hostname, url.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                 + API_KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: " + str(len(payload)).encode()
                 + b"\r\n\r\n" + payload)
    return sock


def _read_sse(sock: socket.socket, timeout: float = 120.0) -> list[dict]:
    """The rest of the response on `sock`, parsed: its SSE `data:` payloads as JSON."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("Host", "x")]))  # state only
    conn.send(h11.EndOfMessage())
    body = bytearray()
    sock.settimeout(timeout)
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(65536))
        elif isinstance(event, h11.Response):
            assert event.status_code == 200
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            break
    lines = [line[len("data: "):] for line in body.decode().splitlines()
             if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_client_that_stops_reading_gives_its_seats_to_others(flow_server):
    """8 unread choices of 2000 tokens fill all 8 seats; once their socket is full they pause,
    and another client's request is served while they are still open."""
    aborted_before = _finished(flow_server, "abort")
    sock = _send_unread(flow_server, {
        "model": MODEL, "prompt": "def f(x):", "n": 8, "max_tokens": 2000, "logprobs": 5,
        "temperature": 1.0, "ignore_eos": True, "stream": True})
    try:
        _wait_paused(flow_server, 8)
        with flow_server.http() as http:
            response = http.post("/v1/completions", json={
                "model": MODEL, "prompt": "x", "max_tokens": 16, "ignore_eos": True})
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 16
        stats = _stats(flow_server)
        assert stats["num_paused"] == 8 and stats["num_running"] == 8  # still there, paused
    finally:
        sock.close()
    wait_idle_and_intact(flow_server)  # closing it aborted all 8 and freed their blocks
    assert _finished(flow_server, "abort") - aborted_before == 8


def test_a_reader_that_pauses_and_reads_again_gets_its_whole_stream(flow_server):
    """Paused, then resumed as it drains: every token arrives once, the same as unpaused."""
    body = {"model": MODEL, "prompt": "def f(x):", "n": 4, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with flow_server.http() as http:
        expected = http.post("/v1/completions",
                             json={**body, "n": 1, "stream": False}).json()["choices"][0]
    sock = _send_unread(flow_server, body)
    try:
        _wait_paused(flow_server, 4)
        events = _read_sse(sock)
    finally:
        sock.close()
    texts, reasons = [""] * 4, [None] * 4
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
            reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
    assert reasons == ["length"] * 4
    assert texts == [expected["text"]] * 4
    stats = wait_idle_and_intact(flow_server)
    assert stats["num_paused"] == 0


def _finished(live, reason: str) -> float:
    with live.http() as http:
        return metric_value(http.get("/metrics").text, "carpool:request_success_total",
                            finished_reason=reason)


# Whole (non-streamed) responses, with pausing at every unread output and the smallest backlog
# limit: neither may touch them (below). 3 blocks a request: 4 seats fill the 12 blocks exactly.
WHOLE_FLAGS = ["--max-num-seqs", "4", "--num-kv-blocks", "12", "--block-size", "16",
               "--max-model-len", "256", "--stream-pause-backlog", "1", "--max-stream-backlog", "1"]


@pytest.fixture(scope="module")
def whole_server(llama_checkpoint, tmp_path_factory):
    with live_server(llama_checkpoint, WHOLE_FLAGS,
                     tmp_path_factory.mktemp("whole") / "server.log") as live:
        yield live


def test_responses_that_are_not_streamed_are_never_paused(whole_server):
    """Flow control is for a client reading a stream. A whole response is read by the server
    itself; when a burst keeps its event loop busy, that reader lags too, and pausing on that
    lag gave seats away to waiting requests: the engine ran more requests than --max-num-seqs
    once they resumed, and preempted them for blocks. Bursts must see neither."""
    body = {"model": MODEL, "prompt": "x = [", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}
    preempted_before = _preemptions(whole_server)

    async def bursts() -> list[int]:  # two, one after the other
        codes = []
        async with whole_server.async_http() as http:
            for _ in range(2):
                responses = await asyncio.gather(
                    *(http.post("/v1/completions", json=body) for _ in range(16)))
                codes += [r.status_code for r in responses]
        return codes

    with watching_stats(whole_server) as seen:
        codes = asyncio.run(bursts())
    assert codes == [200] * 32
    assert max(s["num_paused"] for s in seen) == 0
    assert max(s["num_running"] for s in seen) <= 4
    assert _preemptions(whole_server) == preempted_before
    wait_idle_and_intact(whole_server)


def test_responses_that_are_not_streamed_are_not_cut_off_by_the_stream_backlog(whole_server):
    """--max-stream-backlog ends a stream whose client stopped reading. A whole response's
    n choices put n outputs a step, read by the server's own loop: with a limit of 1 it was
    ended at its first step."""
    with whole_server.http() as http:
        response = http.post("/v1/completions", json={
            "model": MODEL, "prompt": "def f(x):", "n": 4, "max_tokens": 30, "temperature": 0,
            "ignore_eos": True})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["length"] * 4
    assert len({c["text"] for c in choices}) == 1  # greedy: the same text four times
    assert response.json()["usage"]["completion_tokens"] == 4 * 30
    wait_idle_and_intact(whole_server)


def _preemptions(live) -> float:
    with live.http() as http:
        return metric_value(http.get("/metrics").text, "carpool:num_preemptions_total")
