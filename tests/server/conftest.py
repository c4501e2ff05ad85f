"""A real `carpool serve` in a subprocess on a free loopback port, shared by the server tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key-123"
MODEL_NAME = "tiny-llama"
SERVER_FLAGS = ["--num-kv-blocks", "512", "--max-model-len", "256", "--max-num-seqs", "64",
                "--served-model-name", MODEL_NAME, "--api-key", API_KEY, "--log-level", "warning"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    model: str
    checkpoint: Path
    log_path: Path

    def client(self, **kwargs):
        import openai
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0,
                             timeout=60, **kwargs)

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60,
                            headers={"Authorization": f"Bearer {API_KEY}"}, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(checkpoint: Path, log_path: Path, flags: list[str], timeout: float = 120.0) -> Server:
    port = free_port()
    log = open(log_path, "wb")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("CARPOOL_API_KEY", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "carpool.cli", "serve", str(checkpoint), "--port", str(port),
         *flags], stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(process, f"http://127.0.0.1:{port}", MODEL_NAME, checkpoint, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"server not healthy after {timeout}s:\n{server.log()}")


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="session")
def server(llama_checkpoint, tmp_path_factory):
    srv = start_server(llama_checkpoint, tmp_path_factory.mktemp("server") / "server.log",
                       SERVER_FLAGS)
    yield srv
    stop_server(srv)


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
