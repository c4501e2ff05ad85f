"""Hand-written hostile inputs: each gets a 4xx in OpenAI's error body, and the server lives on."""

from __future__ import annotations

import socket

import httpx
import pytest

from tests.reliability.live import API_KEY, MODEL, assert_openai_error, wait_idle_and_intact

pytestmark = pytest.mark.slow  # a live server (still run in CI)

COMPLETION = b'{"model": "%s", "prompt": "x", "max_tokens": 3, %%s}' % MODEL.encode()
CHAT = b'{"model": "%s", "max_tokens": 3, %%s}' % MODEL.encode()
MESSAGES = b'"messages": [{"role": "user", "content": "hi"}]'

NASTY_BODIES = [
    # (route, raw body, the field the error must name, words in the message)
    ("/v1/completions", b'{"prompt": "\xff\xfe\xfd", "max_tokens": 3}', None, ()),
    ("/v1/completions", COMPLETION % b'"prompt": "ab\\ud800cd"', "prompt", ("surrogate",)),
    ("/v1/completions", COMPLETION % b'"stop": ["\\udfff"]', "stop", ("surrogate",)),
    ("/v1/completions", COMPLETION % b'"model": "\\ud800"', "model", ("surrogate",)),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
     "messages", ("surrogate",)),
    ("/tokenize", b'{"prompt": "\\udc00"}', "prompt", ("surrogate",)),
    ("/v1/completions", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None, ()),
    ("/v1/completions", COMPLETION % (b'"user": ' + b'{"a": ' * 20_000 + b"1" + b"}" * 20_000),
     None, ()),
    ("/v1/completions", COMPLETION % b'"max_tokens": 1000000000000', None, ("64",)),
    ("/v1/completions", COMPLETION % b'"n": 1000000', "n", ()),
    ("/v1/completions", COMPLETION % b'"logprobs": 1000000', "logprobs", ()),
    ("/v1/chat/completions", CHAT % b'"messages": []', "messages", ()),
    ("/v1/chat/completions", CHAT % b'"messages": [{"role": "wizard", "content": "hi"}]',
     "messages", ()),
    ("/v1/completions", COMPLETION % b'"prompt": [1, 2, 512]', None, ("out of range",)),
    ("/v1/completions", COMPLETION % b'"prompt": [[5], [-1]]', None, ("out of range",)),
    ("/detokenize", b'{"tokens": [3, 99999999999]}', "tokens", ()),
    ("/v1/completions", COMPLETION % b'"temperature": NaN', "temperature", ()),
    ("/v1/completions", COMPLETION % b'"top_p": Infinity', "top_p", ()),
    ("/v1/completions", COMPLETION % b'"presence_penalty": -Infinity', "presence_penalty", ()),
    ("/v1/completions", COMPLETION % b'"min_p": NaN', "min_p", ()),
    ("/v1/chat/completions", CHAT % (MESSAGES + b', "frequency_penalty": NaN'),
     "frequency_penalty", ()),
    ("/v1/completions", COMPLETION % b'"seed": 1e400', "seed", ()),
]


@pytest.mark.parametrize("path,body,param,mentions", NASTY_BODIES,
                         ids=[f"{i}-{p}" for i, (p, *_) in enumerate(NASTY_BODIES)])
def test_nasty_body_is_a_4xx_with_an_openai_error(edge_server, path, body, param, mentions):
    with edge_server.http() as http:
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    error = assert_openai_error(response, 400, *mentions)
    if param is not None:
        assert error["param"] == param, error


def test_ten_megabyte_body_is_rejected_before_it_is_read(edge_server):
    """Content-Length over the limit: a 413 comes back while most of the body is unsent."""
    port = int(edge_server.base_url.rsplit(":", 1)[1])
    size = 10 * 2**20
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + b'{"prompt": "' + b"a" * 65536)  # then stop sending
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    assert status_line.split()[1] == b"413", reply[:300]
    assert b"--max-request-body-bytes" in rest and b'"code":"request_too_large"' in rest


def test_streamed_body_over_the_limit_is_counted_and_rejected(edge_server):
    """No Content-Length (chunked upload): the bytes are counted as they arrive."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * 65536  # 2.5 MiB in all, over the 1 MiB limit
        yield b'"}'

    with edge_server.http() as http:
        response = http.post("/v1/completions", content=chunks(),
                             headers={"Content-Type": "application/json"})
    assert_openai_error(response, 413, "1048576")


def test_body_just_under_the_limit_is_parsed(edge_server):
    """The limit is on bytes, not a blanket refusal: a 0.9 MiB prompt reaches validation."""
    body = b'{"prompt": "' + b"a " * 450_000 + b'", "max_tokens": 1}'
    with edge_server.http() as http:
        response = http.post("/v1/completions", content=body,
                             headers={"Content-Type": "application/json"})
    assert_openai_error(response, 400, "maximum context length")


def test_server_still_serves_after_the_nasties(edge_server):
    with edge_server.http() as http:
        response = http.post("/v1/completions", json={
            "model": MODEL, "prompt": "def f(x):", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 5
        assert httpx.get(f"{edge_server.base_url}/health").status_code == 200
    wait_idle_and_intact(edge_server)
