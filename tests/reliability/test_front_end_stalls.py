"""Issue 21 items 2-4 through the engine process: work of one client on the front end
(a 4 MB text prompt, a 4 MB chat message, /tokenize of one, tight /metrics pollers) must
not stall another client's stream. Tokenizing and chat templates run on the tokenizer
thread, the engine's steps in their own process and the Prometheus objects are filled by
the front end's receiver thread, so a victim stream's largest gap stays under a second.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.reliability.live import MODEL, live_server

pytestmark = pytest.mark.slow  # a live server (still run in CI)

FLAGS = ["--max-model-len", "512", "--max-num-seqs", "8", "--num-kv-blocks", "128",
         "--max-request-body-bytes", "8MiB"]
BIG_TEXT = "the quick brown fox jumps over the lazy dog " * (4 * 2**20 // 44)  # ~4 MB
MAX_GAP_S = 1.0


@pytest.fixture(scope="module")
def stall_server(llama_checkpoint, tmp_path_factory):
    with live_server(llama_checkpoint, FLAGS,
                     tmp_path_factory.mktemp("stalls") / "server.log") as live:
        yield live


async def _victim(http: httpx.AsyncClient, started: asyncio.Event) -> list[float]:
    """One greedy 200-token stream; the gaps between its chunks (seconds)."""
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times, finished = [], False
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
                started.set()
                finished = finished or json.loads(line[6:])["choices"][0]["finish_reason"]
    assert finished == "length"
    return [b - a for a, b in zip(times, times[1:])]


async def _big_prompt(http: httpx.AsyncClient) -> None:
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": BIG_TEXT,
                                                        "max_tokens": 4})
    assert response.status_code == 400 and "maximum context length" in response.text


async def _big_chat(http: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": BIG_TEXT}]
    response = await http.post("/v1/chat/completions",
                               json={"model": MODEL, "messages": messages, "max_tokens": 4})
    assert response.status_code == 400 and "maximum context length" in response.text


async def _big_tokenize(http: httpx.AsyncClient) -> None:
    response = await http.post("/tokenize", json={"model": MODEL, "prompt": BIG_TEXT})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


async def _metrics_poller(http: httpx.AsyncClient, done: asyncio.Event) -> int:
    num_polls = 0
    while not done.is_set():
        assert (await http.get("/metrics")).status_code == 200
        num_polls += 1
    return num_polls


@pytest.mark.parametrize("attack", ["text-prompt", "chat-message", "tokenize", "metrics"])
def test_front_end_work_does_not_stall_another_stream(stall_server, attack):
    async def scenario():
        async with stall_server.async_http() as http:
            started, done = asyncio.Event(), asyncio.Event()
            victim = asyncio.ensure_future(_victim(http, started))
            await started.wait()
            if attack == "metrics":
                pollers = [asyncio.ensure_future(_metrics_poller(http, done)) for _ in range(4)]
                gaps = await victim
                done.set()
                assert min(await asyncio.gather(*pollers)) > 0
                return gaps
            send = {"text-prompt": _big_prompt, "chat-message": _big_chat,
                    "tokenize": _big_tokenize}[attack]
            for _ in range(2):  # two at once, then the victim's end
                await asyncio.gather(send(http), send(http))
            return await victim

    gaps = asyncio.run(scenario())
    assert max(gaps) < MAX_GAP_S, f"{attack}: the victim stalled {max(gaps):.2f}s"
