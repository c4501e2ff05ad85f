"""Engine faults and SIGTERM, against real server processes.

A fault inside a step fails that step's requests (500 body; `finish_reason`
"error" on streams), frees their blocks, and the server serves on. A fault
the step loop cannot contain makes the server say 503 and exit non-zero.
SIGTERM stops new work, lets in-flight requests finish within
`--shutdown-timeout`, ends the rest with a clear error, and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.reliability.live import (MODEL, assert_openai_error, fault_server, greedy_texts,
                                        wait_idle_and_intact)
from tests.reliability.fault_server import LOOP_FAULT_PROMPT, SLOW_PROMPT, STEP_FAULT_PROMPT

pytestmark = pytest.mark.slow  # a live server (still run in CI)

FLAGS = ["--max-num-seqs", "8", "--num-kv-blocks", "256", "--max-model-len", "256"]
PROMPTS = ["import os\n", "class Foo:", "for i in range(", "def main():"]


def _body(prompt, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}


@dataclass
class _Stream:
    """One streamed completion read in the background; `started` is set at its first chunk."""

    events: list[dict] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    status: int | None = None
    done: bool = False

    @property
    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in self.events for c in e.get("choices", [])
                if c.get("finish_reason")]

    @property
    def errors(self) -> list[dict]:
        return [e["error"] for e in self.events if "error" in e]

    async def run(self, http: httpx.AsyncClient, body: dict) -> None:
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            self.status = r.status_code
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    self.events.append(json.loads(line[len("data: "):]))
                    self.started.set()
        self.started.set()


def _start(http, body) -> tuple[_Stream, asyncio.Task]:
    stream = _Stream()
    return stream, asyncio.ensure_future(stream.run(http, body))


SHUTDOWN_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def faulty(llama_checkpoint, tmp_path_factory):
    """One fault server for the contained fault and then the SIGTERM test, which stops it."""
    flags = [*FLAGS, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    with fault_server(llama_checkpoint, flags,
                      tmp_path_factory.mktemp("faulty") / "server.log") as live:
        yield live


def test_step_fault_fails_its_step_frees_blocks_and_serving_goes_on(faulty, reference_llm):
    async def scenario(live):
        async with live.async_http() as http:
            streams = [_start(http, _body(p, 240)) for p in PROMPTS]
            for stream, _ in streams:
                await stream.started.wait()
            faulty = await http.post("/v1/completions", json=_body(STEP_FAULT_PROMPT, 4))
            await asyncio.gather(*(task for _, task in streams))
            return faulty, [s for s, _ in streams]

    live = faulty
    failed, streams = asyncio.run(scenario(live))
    error = assert_openai_error(failed, 500, "injected step fault")
    assert error["type"] == "server_error"
    for stream in streams:  # running beside it: in the same step, failed with it
        assert stream.finish_reasons == ["error"] and stream.done
    wait_idle_and_intact(live)
    with live.http() as http:  # the engine serves on, correctly
        after = [http.post("/v1/completions", json=_body(p, 12)).json() for p in PROMPTS]
    assert [a["choices"][0]["text"] for a in after] == greedy_texts(reference_llm, PROMPTS, 12)
    wait_idle_and_intact(live)
    assert live.local.process.poll() is None


def test_step_loop_fault_makes_health_503_and_the_process_exit_nonzero(llama_checkpoint,
                                                                       tmp_path):
    async def scenario(live):
        async with live.async_http() as http:
            bystander, task = _start(http, _body(PROMPTS[0], 240))
            await bystander.started.wait()
            fatal = await http.post("/v1/completions", json=_body(LOOP_FAULT_PROMPT, 4))
            await task
            return fatal, bystander

    with fault_server(llama_checkpoint, FLAGS, tmp_path / "server.log") as live:
        fatal, bystander = asyncio.run(scenario(live))
        health = _health_after_death(live.base_url)
        exit_code = live.local.process.wait(timeout=60)
    assert fatal.status_code in (500, 503), fatal.text
    assert_openai_error(fatal, fatal.status_code)
    assert bystander.done and bystander.errors and bystander.errors[0]["code"] == "engine_dead"
    assert health != 200
    assert exit_code == 1, live.log()[-2000:]
    assert "injected step-loop fault" in live.log()


def _health_after_death(base_url: str) -> int | None:
    """/health's status now: 503 while the dying server still answers, None once it is gone."""
    try:
        return httpx.get(f"{base_url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return None


def test_sigterm_drains_in_flight_aborts_the_rest_and_exits_zero(faulty):
    """Last in this module: it stops the shared server."""
    # A slow prompt keeps its requests (50 ms a step, 200 steps) running past the timeout.
    slow = _body(SLOW_PROMPT, 200)

    async def scenario(live):
        async with live.async_http() as http:
            lingering, lingering_task = _start(http, slow)
            whole_task = asyncio.ensure_future(http.post("/v1/completions", json=slow))
            await _wait_running(http, 2)
            # Every step is slow now, so these 8-token requests are still running at SIGTERM.
            quick = [_start(http, _body(p, 8)) for p in PROMPTS[:2]]
            for stream, _ in quick:
                await stream.started.wait()
            live.local.process.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            await asyncio.sleep(0.3)
            refused = await _try_new_request(live.base_url)
            *_, whole = await asyncio.gather(*(t for _, t in quick), lingering_task, whole_task)
            return quick, lingering, whole, refused, time.monotonic() - sent

    live = faulty
    quick, lingering, whole, refused, drained_in = asyncio.run(scenario(live))
    exit_code = live.local.process.wait(timeout=60)
    for stream, _ in quick:  # in flight at SIGTERM and quick: finished normally
        assert stream.finish_reasons == ["length"] and stream.done and not stream.errors
    assert lingering.done and len(lingering.errors) == 1, lingering.events[-3:]
    for error in (lingering.errors[0], assert_openai_error(whole, 503)):
        assert error["code"] == "server_shutting_down"
        assert "--shutdown-timeout" in error["message"]
    assert refused is None or refused == 503
    assert SHUTDOWN_TIMEOUT_S - 0.5 < drained_in < SHUTDOWN_TIMEOUT_S + 10
    assert exit_code == 0, live.log()[-2000:]
    assert "aborted 2 unfinished response(s)" in live.log()


async def _wait_running(http: httpx.AsyncClient, num_requests: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (await http.get("/stats")).json()["num_running"] < num_requests:
        assert time.monotonic() < deadline, f"{num_requests} requests never ran together"
        await asyncio.sleep(0.02)


async def _try_new_request(base_url: str) -> int | None:
    """A new request during the drain: refused (None: connection refused) or a 503."""
    try:
        async with httpx.AsyncClient(timeout=5) as fresh:
            response = await fresh.get(f"{base_url}/health")
            return response.status_code
    except httpx.HTTPError:
        return None
