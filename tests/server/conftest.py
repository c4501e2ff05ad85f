"""A real `carpool serve` in a subprocess on a free loopback port, shared by the server tests."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from carpool.bench.local_server import LocalServer

API_KEY = "test-key-123"
MODEL_NAME = "tiny-llama"
SERVER_FLAGS = ["--num-kv-blocks", "512", "--max-model-len", "256", "--max-num-seqs", "64",
                "--served-model-name", MODEL_NAME, "--api-key", API_KEY]


@dataclass
class Server:
    local: LocalServer
    base_url: str
    model: str
    checkpoint: Path

    def client(self, **kwargs):
        import openai
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0,
                             timeout=60, **kwargs)

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60,
                            headers={"Authorization": f"Bearer {API_KEY}"}, **kwargs)


@pytest.fixture(scope="session")
def server(llama_checkpoint, tmp_path_factory):
    local = LocalServer(llama_checkpoint, SERVER_FLAGS,
                        tmp_path_factory.mktemp("server") / "server.log")
    with local as base_url:
        yield Server(local, base_url, MODEL_NAME, Path(llama_checkpoint))


@pytest.fixture(scope="session")
def client(server):
    return server.client()


def wait_until_idle(server: Server, timeout: float = 30.0) -> dict:
    """Poll /stats until no request is running or waiting; returns the last snapshot."""
    deadline = time.monotonic() + timeout
    with server.http() as http:
        while True:
            snapshot = http.get("/stats").json()
            if snapshot["num_running"] == 0 and snapshot["num_waiting"] == 0:
                return snapshot
            if time.monotonic() > deadline:
                raise AssertionError(f"server still busy after {timeout}s: {snapshot}")
            time.sleep(0.05)


def metric_value(text: str, name: str, **labels) -> float:
    """The value of one sample in Prometheus text format (labels must match those given)."""
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        sample = head.split("{")[0]
        if sample != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    raise KeyError(f"{name} {labels} not in metrics")
