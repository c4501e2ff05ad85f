"""Two `carpool serve` processes on loopback behind SGLang's router (`sglang-router` on PyPI,
the `router` extra), as docs/DATA_PARALLEL.md's multi-node recipe runs them: the router
registers both (reading /server_info and /model_info), the openai client's greedy
completions and a streamed chat through it equal what one server answers directly, and
both servers served some. The servers keep their --api-key: the router forwards the
client's key, and a request without it gets the server's 401."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from carpool.bench.local_server import LocalServer, free_port
from tests.server.live import API_KEY, MODEL_NAME, metric_value

pytest.importorskip("sglang_router", reason="the router extra (sglang-router) is not installed")
pytestmark = pytest.mark.slow  # live servers (still run in CI)

FLAGS = ["--num-kv-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "8",
         "--served-model-name", MODEL_NAME, "--api-key", API_KEY]
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "x = ["]


@contextlib.contextmanager
def router(worker_urls: list[str], log_path: Path):
    port = free_port()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
             "--port", str(port), "--policy", "round_robin", "--worker-urls", *worker_urls],
            stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_registered(base_url, process, log_path)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_registered(base_url: str, process: subprocess.Popen, log_path: Path) -> None:
    """Until the router lists the served model (its workers registered)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
        with contextlib.suppress(httpx.HTTPError, ValueError):
            models = httpx.get(f"{base_url}/v1/models", timeout=2).json()
            if [m["id"] for m in models.get("data", [])] == [MODEL_NAME]:
                return
        time.sleep(0.3)
    raise AssertionError(log_path.read_text(errors="replace")[-3000:])


def test_two_servers_behind_sglangs_router(llama_checkpoint, tmp_path):
    import openai

    env = {"OMP_NUM_THREADS": "1"}
    with LocalServer(llama_checkpoint, FLAGS, tmp_path / "a.log", env=env) as a, \
            LocalServer(llama_checkpoint, FLAGS, tmp_path / "b.log", env=env) as b:
        direct = openai.OpenAI(base_url=f"{a}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        expected = [direct.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8,
                                              temperature=0).choices[0].text for p in PROMPTS]
        chat = [{"role": "user", "content": "Print the first ten squares."}]
        expected_chat = direct.chat.completions.create(
            model=MODEL_NAME, messages=chat, max_tokens=8, temperature=0).choices[0]
        served_before = [_num_served(url) for url in (a, b)]

        with router([a, b], tmp_path / "router.log") as routed_url:
            routed = openai.OpenAI(base_url=f"{routed_url}/v1", api_key=API_KEY,
                                   max_retries=0, timeout=60)
            texts = [routed.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8,
                                               temperature=0).choices[0].text for p in PROMPTS]
            stream = routed.chat.completions.create(model=MODEL_NAME, messages=chat,
                                                    max_tokens=8, temperature=0, stream=True)
            chunks = list(stream)
            keyless = httpx.post(f"{routed_url}/v1/completions", timeout=60,
                                 json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1})
        assert keyless.status_code == 401, keyless.text
        assert texts == expected
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            expected_chat.message.content
        assert chunks[-1].choices[0].finish_reason == expected_chat.finish_reason
        served = [_num_served(url) - before for url, before in zip((a, b), served_before)]
        assert sum(served) == len(PROMPTS) + 1 and min(served) > 0, served


def _num_served(base_url: str) -> float:
    metrics = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(metric_value(metrics, "carpool:request_success_total", finished_reason=reason)
               for reason in ("length", "stop"))
