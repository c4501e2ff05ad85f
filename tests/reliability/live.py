"""Real `carpool serve` processes on loopback for the reliability tests, and what they check
(importable helpers; the fixtures are in conftest.py).

Every test here talks to a server in its own process over 127.0.0.1, as a
client would, and ends by asking the server itself whether anything leaked:
`/stats?integrity=true` runs the block manager's integrity check on the loop
thread, and `/metrics` must agree that no KV block is in use.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

from carpool.bench.local_server import LocalServer
from tests.server.live import metric_value

API_KEY = "reliability-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "tiny-llama"
# float32: the references are the offline engine's greedy outputs alone, and a preempted request
# is recomputed by a prefill; in bfloat16 that prefill may round a near tie the other way.
BASE_FLAGS = ["--served-model-name", MODEL, "--api-key", API_KEY, "--log-level", "info",
              "--dtype", "float32"]


@dataclass
class Live:
    """A running server: its URL, process and log."""

    local: LocalServer
    base_url: str

    @property
    def pid(self) -> int:
        return self.local.process.pid

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60, headers=AUTH, **kwargs)

    def async_http(self, **kwargs) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        return httpx.AsyncClient(base_url=self.base_url, timeout=120, headers=AUTH,
                                 limits=limits, **kwargs)

    def log(self) -> str:
        return self.local.log()


@contextlib.contextmanager
def live_server(checkpoint: Path, flags: list[str], log_path: Path) -> Iterator[Live]:
    """A server subprocess with one torch thread: on a shared, oversubscribed CPU, OpenMP's
    spinning workers make every step of a tiny model many times slower."""
    local = LocalServer(checkpoint, [*BASE_FLAGS, *flags], log_path)
    with _environ(OMP_NUM_THREADS="1"), local as base_url:
        yield Live(local, base_url)


@contextlib.contextmanager
def fault_server(checkpoint: Path, flags: list[str], log_path: Path) -> Iterator[Live]:
    """A server whose engine faults on request (see fault_server.py)."""
    script = Path(__file__).with_name("fault_server.py")
    local = LocalServer(checkpoint, [*BASE_FLAGS, *flags], log_path,
                        launcher=(sys.executable, str(script)), env={"OMP_NUM_THREADS": "1"})
    with local as base_url:
        yield Live(local, base_url)


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def watching_stats(live: Live, interval: float = 0.005) -> Iterator[list[dict]]:
    """Polls /stats from a thread while the block runs; yields the list the snapshots go to."""
    seen: list[dict] = []
    done = threading.Event()

    def poll() -> None:
        with live.http() as http:
            while not done.is_set():
                seen.append(http.get("/stats").json())
                time.sleep(interval)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        yield seen
    finally:
        done.set()
        poller.join()


def greedy_texts(llm, prompts: list[str], max_tokens: int) -> list[str]:
    from carpool import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [out.outputs[0].text for out in llm.generate(prompts, params, use_tqdm=False)]


def wait_idle_and_intact(live: Live, timeout: float = 60.0) -> dict:
    """Wait until nothing runs or waits, then check every block is free, by the engine's own
    integrity check and by /metrics; returns the checked stats."""
    deadline = time.monotonic() + timeout
    with live.http() as http:
        while True:
            stats = http.get("/stats", params={"integrity": "true"}).json()
            if stats["num_running"] == 0 and stats["num_waiting"] == 0:
                break
            assert time.monotonic() < deadline, f"server still busy after {timeout}s: {stats}"
            time.sleep(0.1)
        metrics = http.get("/metrics").text
    assert stats["integrity"] == "ok", stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert metric_value(metrics, "carpool:kv_cache_usage_perc") == 0.0
    assert metric_value(metrics, "carpool:num_requests_running") == 0.0
    return stats


def assert_openai_error(response: httpx.Response, status: int, *mentions: str) -> dict:
    """The response is `status` with exactly OpenAI's error body; returns the error object."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    for word in mentions:
        assert word in error["message"], error["message"]
    return error


def sse_payloads(lines: list[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


# The server the input tests (fuzzing, hand-written nasties, security) share: short
# contexts so generated max_tokens stay cheap, a 1 MiB body limit.
EDGE_FLAGS = ["--max-model-len", "64", "--max-num-seqs", "16", "--num-kv-blocks", "128",
              "--max-request-body-bytes", "1MiB", "--enable-log-requests"]
