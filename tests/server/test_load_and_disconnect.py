"""Many concurrent streams finish with the right counts; clients that leave free their blocks."""

from __future__ import annotations

import pytest

import asyncio
import socket
import time

import httpx
import openai

from tests.server.live import API_KEY, metric_value, wait_until_idle

pytestmark = pytest.mark.slow  # a live server (still run in CI)

PROMPTS = ["import os\n", "class Foo:", "for i in range(", "def main():", "x = [", "return "]


def _metrics(server) -> str:
    with server.http() as http:
        return http.get("/metrics").text


def _aborts(server) -> float:
    try:
        return metric_value(_metrics(server), "carpool:request_success_total",
                            finished_reason="abort")
    except KeyError:
        return 0.0


def _wait_for_aborts(server, before: float, expected: int) -> None:
    """The abort count rises by exactly `expected` (it is recorded one step after the abort)."""
    deadline = time.monotonic() + 20
    while _aborts(server) - before < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborts(server) - before == expected


def _assert_all_blocks_free(server) -> None:
    snapshot = wait_until_idle(server)
    assert snapshot["num_free_blocks"] == snapshot["num_total_blocks"], snapshot
    assert metric_value(_metrics(server), "carpool:kv_cache_usage_perc") == 0.0


def test_fifty_concurrent_streams_complete_with_correct_counts(server):
    async def one(client, i: int):
        max_tokens = 4 + i % 9
        chunks = [c async for c in await client.completions.create(
            model=server.model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens,
            temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})]
        return max_tokens, chunks

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY,
                                    max_retries=0, timeout=120)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(50)))

    results = asyncio.run(main())
    assert len(results) == 50
    for max_tokens, chunks in results:
        usage = chunks[-1].usage
        assert usage.completion_tokens == max_tokens
        finish = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason]
        assert finish == ["length"]
    _assert_all_blocks_free(server)


def test_clients_closing_mid_stream_are_aborted_and_blocks_freed(server):
    aborts_before = _aborts(server)
    num_leavers = 4
    choices_per_leaver = [1 + i % 2 for i in range(num_leavers)]  # n=2 leavers too

    async def leaver(client, i: int) -> int:
        stream = await client.completions.create(
            model=server.model, prompt=PROMPTS[i], max_tokens=200, temperature=0, stream=True,
            n=choices_per_leaver[i], extra_body={"ignore_eos": True})
        received = 0
        async for _ in stream:
            received += 1
            if received == 3:
                break
        await stream.close()
        return received

    async def stayer(client, i: int) -> int:
        out = await client.completions.create(
            model=server.model, prompt=PROMPTS[i], max_tokens=10, temperature=0,
            extra_body={"ignore_eos": True})
        return out.usage.completion_tokens

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY,
                                    max_retries=0, timeout=120)
        async with client:
            return await asyncio.gather(*(leaver(client, i) for i in range(num_leavers)),
                                        *(stayer(client, i) for i in range(3)))

    results = asyncio.run(main())
    assert results[:num_leavers] == [3] * num_leavers and results[num_leavers:] == [10] * 3
    _wait_for_aborts(server, aborts_before, sum(choices_per_leaver))
    _assert_all_blocks_free(server)


def test_non_streaming_client_that_leaves_is_aborted(server):
    aborts_before = _aborts(server)
    body = {"model": server.model, "prompt": "while True:", "max_tokens": 240, "temperature": 0,
            "ignore_eos": True, "n": 2}
    # The client gives up after 20 ms: far less than 2 x 240 tokens take, even on a quiet machine.
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(10, read=0.02),
                      headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        for _ in range(2):
            try:
                http.post("/v1/completions", json=body)
            except httpx.ReadTimeout:
                pass
            else:
                raise AssertionError("240 tokens in 0.02 s: make the request longer")
    _wait_for_aborts(server, aborts_before, 4)  # two clients, n=2 each
    _assert_all_blocks_free(server)


def _raw_streaming_request(server) -> tuple[tuple[str, int], bytes]:
    host, port = server.base_url.removeprefix("http://").split(":")
    payload = (b'{"model": "%s", "prompt": "if x:", "max_tokens": 200, "stream": true, '
               b'"ignore_eos": true}' % server.model.encode())
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
               b"Content-Length: %d\r\n\r\n" % len(payload)) + payload
    return (host, int(port)), request


def _finished_length(server) -> float:
    return metric_value(_metrics(server), "carpool:request_success_total",
                        finished_reason="length")


def test_client_gone_before_the_first_token_is_aborted(server):
    """A raw socket that reads the status line of its stream (so the engine has the
    request) and hangs up before reading a token."""
    aborts_before = _aborts(server)
    address, request = _raw_streaming_request(server)
    for _ in range(3):
        with socket.create_connection(address) as sock:
            sock.sendall(request)
            assert sock.recv(12, socket.MSG_WAITALL) == b"HTTP/1.1 200"
    _wait_for_aborts(server, aborts_before, 3)
    _assert_all_blocks_free(server)


def test_client_gone_while_its_request_is_read_leaves_nothing_running(server):
    """A raw socket that hangs up right after sending: whether the server notices before
    the engine has the request (a 499, nothing to abort) or after (an abort) is a race,
    but none of the requests may run to its end, and no block may stay taken."""
    wait_until_idle(server)
    aborts_before, length_before = _aborts(server), _finished_length(server)
    address, request = _raw_streaming_request(server)
    for _ in range(3):
        with socket.create_connection(address) as sock:
            sock.sendall(request)
    # Sent after the three, so by the time it has finished and the engine is idle, any of
    # them that reached the engine has ended too.
    probe = server.client().completions.create(model=server.model, prompt="x", max_tokens=1)
    assert probe.choices[0].finish_reason == "length"
    _assert_all_blocks_free(server)
    assert _finished_length(server) == length_before + 1
    assert _aborts(server) - aborts_before <= 3


def test_metrics_exposes_the_carpool_names(server, client):
    client.completions.create(model=server.model, prompt="x = 1", max_tokens=3)
    wait_until_idle(server)
    text = _metrics(server)
    for name in ("carpool:num_requests_running", "carpool:num_requests_waiting",
                 "carpool:kv_cache_usage_perc", "carpool:prompt_tokens_total",
                 "carpool:generation_tokens_total", "carpool:num_preemptions_total",
                 "carpool:time_to_first_token_seconds_count",
                 "carpool:inter_token_latency_seconds_count",
                 "carpool:e2e_request_latency_seconds_count",
                 "carpool:request_queue_time_seconds_count",
                 "carpool:iteration_tokens_total_count", "carpool:request_num_preemptions_count"):
        assert metric_value(text, name, model_name=server.model) >= 0, name
    assert metric_value(text, "carpool:request_success_total", finished_reason="length") >= 1
    assert metric_value(text, "carpool:generation_tokens_total") >= 3
    assert metric_value(text, "carpool:e2e_request_latency_seconds_count") >= 1
    assert metric_value(text, "carpool:num_requests_running") == 0
