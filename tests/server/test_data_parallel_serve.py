"""`carpool serve --data-parallel-size 2` as a user runs it, against real processes on loopback.

One server: the openai client's greedy completions, sent at once, equal one
replica's (the offline `LLM`) and both replicas served some (their `engine`
labels in /metrics); two streams dropped mid-way are aborted each on its own
replica (one abort per engine label, every block free again by both replicas'
integrity checks); SIGTERM drains and exits 0 with no engine process left.
Another, with `-tp 2` too (2 × 2 processes): a replica killed mid-stream fails its
stream, turns /health 503, and the server exits 1 leaving no replica or rank behind. And `-dp 2` with
`--no-engine-process` is refused before any port is bound.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from carpool.bench.local_server import LocalServer
from tests.reliability.test_engine_process import engine_pids, wait_gone
from tests.server.live import API_KEY, MODEL_NAME, Server, metric_value

pytestmark = pytest.mark.slow  # live servers (still run in CI)

FLAGS = ["--num-kv-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "8",
         "--served-model-name", MODEL_NAME, "--api-key", API_KEY, "--data-parallel-size", "2",
         "--dtype", "float32"]  # batches differ from the reference's: float32 keeps near ties
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(10):",
           "x = [", "while True:"]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def one_replica_texts(llama_checkpoint) -> list[str]:
    from carpool import LLM, SamplingParams

    llm = LLM(str(llama_checkpoint), dtype="float32", num_kv_blocks=64, max_model_len=256)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12),
                           use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


def dp_server(checkpoint: Path, log_path: Path, *flags: str) -> LocalServer:
    return LocalServer(checkpoint, [*FLAGS, *flags], log_path, env={"OMP_NUM_THREADS": "1"})


def test_dp2_serves_one_replicas_text_on_both_aborts_on_the_right_one_and_drains(
        llama_checkpoint, tmp_path, one_replica_texts):
    local = dp_server(llama_checkpoint, tmp_path / "server.log")
    with local as base_url:
        server = Server(local, base_url, MODEL_NAME, Path(llama_checkpoint))
        replicas = engine_pids(local.process.pid)
        assert len(replicas) == 2, replicas
        client = server.client()

        def complete(prompt: str) -> str:
            return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12,
                                             temperature=0).choices[0].text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(complete, PROMPTS)) == one_replica_texts
        with server.http() as http:
            metrics = http.get("/metrics").text
        served = [metric_value(metrics, "carpool:request_success_total", engine=str(e),
                               finished_reason="length") for e in (0, 1)]
        assert sum(served) == len(PROMPTS) and min(served) > 0, served

        _drop_two_streams(base_url)
        with server.http() as http:
            stats = _wait_idle(http)
            metrics = http.get("/metrics").text
        assert stats["integrity"] == "ok", stats
        assert [e["num_free_blocks"] for e in stats["engines"]] == [64, 64], stats
        aborts = [metric_value(metrics, "carpool:request_success_total", engine=str(e),
                               finished_reason="abort") for e in (0, 1)]
        assert aborts == [1.0, 1.0], aborts

        local.process.send_signal(signal.SIGTERM)
        assert local.process.wait(timeout=60) == 0, local.log()[-2000:]
    assert all(wait_gone(pid, 15) for pid in replicas), replicas
    assert "2 data-parallel replicas" in local.log()
    assert "did not stop" not in local.log()  # each replica exited on Stop, none was killed


def _drop_two_streams(base_url: str) -> None:
    """Two long streams at once (the second goes to the other, less loaded, replica), each
    closed after its first chunk."""
    body = {"model": MODEL_NAME, "prompt": "def main():", "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=base_url, headers=AUTH, timeout=60) as first, \
            httpx.Client(base_url=base_url, headers=AUTH, timeout=60) as second:
        with first.stream("POST", "/v1/completions", json=body) as a, \
                second.stream("POST", "/v1/completions", json=body) as b:
            for response in (a, b):
                assert response.status_code == 200
                next(response.iter_lines())


def _wait_idle(http: httpx.Client, timeout: float = 60.0) -> dict:
    import time
    deadline = time.monotonic() + timeout
    while True:
        stats = http.get("/stats", params={"integrity": "true"}).json()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


def test_a_killed_replica_fails_its_stream_turns_health_503_and_ends_the_server(
        llama_checkpoint, tmp_path):
    """With -tp 2: four processes, two ranks per replica; none may outlive the server."""
    local = dp_server(llama_checkpoint, tmp_path / "server.log", "--tensor-parallel-size", "2")
    with local as base_url:
        replicas = sorted(engine_pids(local.process.pid))  # replica 0 was spawned first
        assert len(replicas) == 2, replicas
        ranks = [pid for replica in replicas for pid in engine_pids(replica)]
        assert len(ranks) == 2, ranks  # each replica's rank 1
        body = {"model": MODEL_NAME, "prompt": "def main():", "max_tokens": 200,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=base_url, headers=AUTH, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as stream:
                lines = stream.iter_lines()
                next(lines)
                engines = http.get("/stats", params={"integrity": "true"}).json()["engines"]
                (busy,) = [i for i, e in enumerate(engines) if e["num_running"]]
                os.kill(replicas[busy], signal.SIGKILL)
                rest = [line for line in lines if line]
            try:
                health = http.get("/health").status_code
            except httpx.HTTPError:
                health = None  # already gone
        exit_code = local.process.wait(timeout=60)
    log = local.log()
    assert exit_code == 1, log[-2000:]
    assert health in (503, None)
    assert "engine replica" in log and "engine process exited" in log
    assert all(wait_gone(pid, 15) for pid in replicas + ranks), (replicas, ranks)
    assert rest[-1] == "data: [DONE]" and '"code":"engine_dead"' in rest[-2], rest[-3:]


def test_data_parallel_needs_the_engine_process(llama_checkpoint):
    result = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "serve", str(llama_checkpoint), "-dp", "2",
         "--no-engine-process", "--port", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "--data-parallel-size" in result.stderr and "--no-engine-process" in result.stderr
