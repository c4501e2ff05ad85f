"""Issue 64, the front end's items against a live server: /tokenize and /detokenize
bounded by size (4); a cap on a request's logprob work (5); a big reply read slowly
received whole, the keep-alive read deadline starting only once it is sent (6); and an
engine that has work but steps no more turning /health 503 until it steps again (8).
The API key on the state routes (4) is in test_security.py; the tokenizer's lanes, the
stall clock and the accept-error log on their own in tests/server/test_front_end_guards.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from urllib.parse import urlsplit

import pytest

from tests.reliability.live import (
    API_KEY,
    MODEL,
    assert_openai_error,
    live_server,
    wait_idle_and_intact,
)
from tests.reliability.test_engine_process import engine_pids

pytestmark = pytest.mark.slow  # a live server (still run in CI)

READ_TIMEOUT_S = 1.0
WRITE_TIMEOUT_S = 1.0
STALL_TIMEOUT_S = 2.0
MAX_LOGPROB_WORK = 20000
FLAGS = ["--max-model-len", "512", "--max-num-seqs", "8", "--num-kv-blocks", "256",
         "--http-read-timeout", str(READ_TIMEOUT_S), "--timeout-keep-alive", "60",
         "--http-write-timeout", str(WRITE_TIMEOUT_S),
         "--engine-stall-timeout", str(STALL_TIMEOUT_S),
         "--max-logprob-work", str(MAX_LOGPROB_WORK)]
# 8 choices x 100 tokens x 21 logprobs: a ~0.5 MB reply, within the cap (16,800 entries).
BIG_REPLY = {"model": MODEL, "prompt": "def f(x):", "n": 8, "max_tokens": 100,
             "logprobs": 20, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def hardened_server(llama_checkpoint, tmp_path_factory):
    with live_server(llama_checkpoint, FLAGS,
                     tmp_path_factory.mktemp("hardened") / "server.log") as live:
        yield live


def test_tokenize_and_detokenize_are_bounded_by_the_context_length(edge_server):
    """A text surely longer than max_model_len (64 here) is refused before it is
    tokenized, as a prompt would be, naming the field; so are more ids than that."""
    with edge_server.http() as http:
        error = assert_openai_error(http.post("/tokenize", json={"prompt": "word " * 20000}),
                                    400, "maximum context length")
        assert error["param"] == "prompt"
        messages = [{"role": "user", "content": "word " * 20000}]
        error = assert_openai_error(http.post("/tokenize", json={"messages": messages}), 400,
                                    "maximum context length")
        assert error["param"] == "messages"
        error = assert_openai_error(http.post("/detokenize", json={"tokens": [5] * 65}), 400,
                                    "max_model_len")
        assert error["param"] == "tokens"
        fits = http.post("/tokenize", json={"prompt": "word " * 10}).json()
        assert 0 < fits["count"] <= 64
        text = http.post("/detokenize", json={"tokens": fits["tokens"]}).json()["prompt"]
        assert "word" in text


def test_logprob_work_over_the_cap_is_a_400_naming_it(hardened_server):
    with hardened_server.http() as http:
        over = {**BIG_REPLY, "max_tokens": 200}  # 8 x 200 x 21 = 33,600 entries
        error = assert_openai_error(http.post("/v1/completions", json=over), 400,
                                    "--max-logprob-work")
        assert error["param"] == "logprobs"
        prompts = [[5] * 100] * 10  # 10 x 100 prompt tokens x 21 = 21,000 entries
        error = assert_openai_error(http.post("/v1/completions", json={
            "model": MODEL, "prompt": prompts, "max_tokens": 1, "prompt_logprobs": 20}), 400,
            "--max-logprob-work")
        assert error["param"] == "logprobs"
        response = http.post("/v1/completions", json=BIG_REPLY)  # under it: served whole
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 8
    wait_idle_and_intact(hardened_server)


def _request(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
            b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


def test_a_big_reply_read_slowly_arrives_whole(hardened_server):
    """A ~0.5 MB reply read steadily over several times --http-read-timeout and
    --http-write-timeout: the keep-alive read deadline starts once the reply has left the
    server, and the write deadline counts progress, so it is not cut off (it was, after
    either timeout, with the rest of the reply dropped)."""
    url = urlsplit(hardened_server.base_url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)  # the kernel holds little
    sock.connect((url.hostname, url.port))
    sock.settimeout(30)
    sock.sendall(_request(BIG_REPLY))
    received = b""
    started = time.monotonic()
    try:
        while True:
            chunk = sock.recv(8192)
            if not chunk:
                break
            received += chunk
            head, _, body = received.partition(b"\r\n\r\n")
            length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")]
            if length and len(body) >= length[0]:
                break
            time.sleep(0.05)  # at most ~160 KB/s
    finally:
        sock.close()
    took = time.monotonic() - started
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    assert len(body) > 300_000
    assert len(json.loads(body)["choices"]) == 8  # whole: it parses
    assert took > 2 * max(READ_TIMEOUT_S, WRITE_TIMEOUT_S)  # read for longer than either


def _status(http, path: str) -> tuple[int, dict | None]:
    response = http.get(path)
    return response.status_code, (response.json() if response.content else None)


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_a_stopped_engine_with_work_is_reported_until_it_steps_again(hardened_server):
    """The engine process SIGSTOPped with a request sent to it: /health turns 503 (the
    engine has work and finished no step for --engine-stall-timeout) and /load says
    so; after SIGCONT the request is served and /health is 200 again. An idle engine is
    never stalled, however long it sits."""
    [engine] = engine_pids(hardened_server.pid)
    with hardened_server.http() as http:
        time.sleep(STALL_TIMEOUT_S + 0.5)  # idle for longer than the timeout
        assert http.get("/health").status_code == 200
        assert http.get("/load").json()["engine_stalled"] is False
        os.kill(engine, signal.SIGSTOP)
        try:
            result = {}

            def generate() -> None:
                with hardened_server.http() as own:
                    result["response"] = own.post("/v1/completions", json={
                        "model": MODEL, "prompt": "def f(x):", "max_tokens": 8,
                        "temperature": 0, "ignore_eos": True})

            client = threading.Thread(target=generate)
            client.start()
            assert _wait_for(lambda: http.get("/health").status_code == 503, 30)
            error = assert_openai_error(http.get("/health"), 503, "engine-stall-timeout")
            assert error["code"] == "engine_stalled"
            assert http.get("/load").json()["engine_stalled"] is True
        finally:
            os.kill(engine, signal.SIGCONT)
        client.join(60)
        assert result["response"].status_code == 200, result["response"].text
        assert _wait_for(lambda: http.get("/health").status_code == 200, 30)
        assert http.get("/load").json()["engine_stalled"] is False
    wait_idle_and_intact(hardened_server)
