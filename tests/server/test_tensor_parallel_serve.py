"""`carpool serve --tensor-parallel-size 2` as a user runs it: the openai client gets TP=1's
greedy text and a killed rank takes the server down with status 1 within seconds; the
multi-node launch (one command per rank, env://) on loopback, where SIGTERM to the server
stops both ranks with status 0. (Spawned ranks stop through the same `close()`, which the
offline tests check: rank 1 exits 0.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from carpool.bench.local_server import LocalServer, free_port
from tests.server.live import API_KEY, MODEL_NAME, SERVER_FLAGS, Server

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def worker_pids(server_pid: int) -> list[int]:
    """The worker ranks: processes spawned by the engine process (itself spawned by the
    server), or by the server itself when its engine runs on a thread."""
    def spawned(pid: int) -> list[int]:
        return [c for c in children(pid)
                if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]

    workers = []
    for pid in spawned(server_pid):
        workers += spawned(pid) or [pid]
    return workers


@pytest.fixture(scope="module")
def tp1_texts(llama_checkpoint):
    from carpool import LLM, SamplingParams

    llm = LLM(str(llama_checkpoint), dtype="float32", num_kv_blocks=128, max_model_len=256)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12),
                           use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


def complete_all(server: Server) -> list[str]:
    client = server.client()
    return [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=12,
                                      temperature=0).choices[0].text for p in PROMPTS]


def test_tp2_serves_tp1_text_and_a_killed_rank_ends_the_server(llama_checkpoint, tmp_path,
                                                                tp1_texts):
    local = LocalServer(llama_checkpoint, [*SERVER_FLAGS, "--tensor-parallel-size", "2"],
                        tmp_path / "server.log")
    with local as base_url:
        server = Server(local, base_url, MODEL_NAME, Path(llama_checkpoint))
        assert complete_all(server) == tp1_texts
        assert "tensor parallel: 2 ranks, gloo backend" in local.log()
        [worker] = worker_pids(local.process.pid)
        os.kill(worker, signal.SIGKILL)
        started = time.monotonic()
        statuses = set()
        while local.process.poll() is None and time.monotonic() - started < 15:
            try:
                statuses.add(httpx.get(f"{base_url}/health", timeout=1).status_code)
            except httpx.HTTPError:
                statuses.add("refused")
            time.sleep(0.1)
        assert local.process.poll() == 1, local.log()
        assert time.monotonic() - started < 15
        assert 200 not in statuses or statuses - {200}  # it stopped answering 200
        assert "RankFailedError" in local.log()


def test_one_command_per_rank_through_env_rendezvous(llama_checkpoint, tmp_path, tp1_texts):
    """Two "nodes" on loopback: rank 0 is `carpool serve`, rank 1 `carpool tp-worker`."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE="2", PYTHONUNBUFFERED="1")
    flags = ["--num-kv-blocks", "512", "--max-model-len", "256", "--max-num-seqs", "64",
             "--tensor-parallel-size", "2", "--distributed-init-method", "env://"]
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "carpool.cli", "tp-worker", str(llama_checkpoint), *flags],
            env=dict(env, RANK="1"), stdout=log, stderr=subprocess.STDOUT)
    try:
        local = LocalServer(llama_checkpoint, [*flags, "--served-model-name", MODEL_NAME,
                                               "--api-key", API_KEY],
                            tmp_path / "server.log", env={"MASTER_ADDR": "127.0.0.1",
                                                          "MASTER_PORT": env["MASTER_PORT"],
                                                          "WORLD_SIZE": "2", "RANK": "0"})
        with local as base_url:
            server = Server(local, base_url, MODEL_NAME, Path(llama_checkpoint))
            assert complete_all(server) == tp1_texts
            local.process.send_signal(signal.SIGTERM)
            assert local.process.wait(timeout=30) == 0, local.log()
        assert worker.wait(timeout=15) == 0, (tmp_path / "worker.log").read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
