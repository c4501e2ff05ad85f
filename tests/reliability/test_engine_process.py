"""The engine-core process's lifecycle, against real `carpool serve` processes.

The server binds at once and says 503 until the engine process has loaded the
model; the engine process dying turns /health to 503, ends every open stream
with an error and makes the server exit non-zero; SIGTERM drains and exits 0;
and after every exit, the server's SIGKILL included, no engine process is left.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from carpool.bench.local_server import free_port
from carpool.utils.cpu_threads import DEFAULT_OMP_SPIN_COUNT, OPENMP_WAIT_VARIABLES
from tests.reliability.live import AUTH, BASE_FLAGS, MODEL, live_server

pytestmark = pytest.mark.slow  # live servers (still run in CI)

FLAGS = ["--max-num-seqs", "4", "--num-kv-blocks", "64", "--max-model-len", "128"]


def engine_pids(server_pid: int) -> list[int]:
    """The server's engine-core process(es): its children started by multiprocessing's spawn."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server_pid and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return pids


def allowed_cpus(pid: int) -> str:
    """The CPUs a process's main thread may run on, as /proc lists them ("0-1", "0")."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


def is_alive(pid: int) -> bool:
    """Running (a zombie has exited: only its parent has yet to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while is_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _body(max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": "def main():", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


async def _stream_events(http: httpx.AsyncClient, started: asyncio.Event,
                         max_tokens: int) -> list[str]:
    lines = []
    async with http.stream("POST", "/v1/completions", json=_body(max_tokens)) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[len("data: "):])
                started.set()
    return lines


def test_health_waits_for_the_engine_then_sigterm_drains_and_leaves_no_engine(
        llama_checkpoint, tmp_path):
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "carpool.cli", "serve", str(llama_checkpoint), "--port",
             str(port), *BASE_FLAGS, *FLAGS], stdout=log, stderr=subprocess.STDOUT,
            env={**{name: value for name, value in os.environ.items()
                    if name not in OPENMP_WAIT_VARIABLES}, "OMP_NUM_THREADS": "1"})
    try:
        statuses = _health_until_ok(f"http://127.0.0.1:{port}", process)
        assert statuses[0] == 503 and statuses[-1] == 200, statuses
        (engine_pid,) = engine_pids(process.pid)
        # --cpu-omp-spin-count unset, the environment silent: the engine's OpenMP spins
        # the default count, then sleeps.
        engine_env = dict(entry.split("=", 1) for entry in Path(
            f"/proc/{engine_pid}/environ").read_text().split("\0") if "=" in entry)
        assert engine_env["GOMP_SPINCOUNT"] == str(DEFAULT_OMP_SPIN_COUNT)
        assert engine_env["OMP_WAIT_POLICY"] == "PASSIVE"
        # --cpu-omp-threads-bind auto: the engine process (its one torch thread here) is
        # pinned to the first CPU the server may use; the front end is left free.
        allowed = sorted(os.sched_getaffinity(0))
        assert allowed_cpus(engine_pid) == str(allowed[0])
        assert allowed_cpus(process.pid) == allowed_cpus(os.getpid())

        async def scenario():
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=AUTH,
                                         timeout=60) as http:
                started = asyncio.Event()
                task = asyncio.ensure_future(_stream_events(http, started, 40))
                await started.wait()
                process.send_signal(signal.SIGTERM)
                return await task

        events = asyncio.run(scenario())
        assert process.wait(timeout=60) == 0, log_path.read_text()[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
    assert events[-1] == "[DONE]" and '"finish_reason":"length"' in events[-2], events[-3:]
    assert wait_gone(engine_pid, 10)


def _health_until_ok(base_url: str, process: subprocess.Popen, timeout: float = 180) -> list:
    """/health's answers from the first to the first 200 (connection refusals left out)."""
    statuses: list[int] = []
    deadline = time.monotonic() + timeout
    while not statuses or statuses[-1] != 200:
        assert process.poll() is None and time.monotonic() < deadline, statuses
        try:
            statuses.append(httpx.get(f"{base_url}/health", timeout=5).status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return statuses


def test_engine_process_death_fails_streams_turns_health_503_and_exits_nonzero(
        llama_checkpoint, tmp_path):
    with live_server(llama_checkpoint, FLAGS, tmp_path / "server.log") as live:
        (engine_pid,) = engine_pids(live.pid)

        async def scenario():
            async with live.async_http() as http:
                started = asyncio.Event()
                task = asyncio.ensure_future(_stream_events(http, started, 120))
                await started.wait()
                os.kill(engine_pid, signal.SIGKILL)
                events = await task
                try:
                    health = (await http.get("/health")).status_code
                except httpx.HTTPError:
                    health = None  # already gone
                return events, health

        events, health = asyncio.run(scenario())
        exit_code = live.local.process.wait(timeout=60)
        log = live.log()
    assert events[-1] == "[DONE]" and '"code":"engine_dead"' in events[-2], events[-3:]
    assert health in (503, None)
    assert exit_code == 1, log[-2000:]
    assert "engine process exited" in log


def test_engine_process_exits_when_the_server_is_killed(llama_checkpoint, tmp_path):
    with live_server(llama_checkpoint, FLAGS, tmp_path / "server.log") as live:
        (engine_pid,) = engine_pids(live.pid)

        async def scenario():  # the engine is mid-request when its server vanishes
            async with live.async_http() as http:
                started = asyncio.Event()
                task = asyncio.ensure_future(_stream_events(http, started, 120))
                await started.wait()
                live.local.process.kill()
                try:
                    await task
                except httpx.HTTPError:
                    pass

        asyncio.run(scenario())
        live.local.process.wait(timeout=30)
        assert wait_gone(engine_pid, 15), "the engine process outlived its server"


def test_no_engine_process_serves_the_same_text_from_a_thread(llama_checkpoint, tmp_path,
                                                               reference_llm):
    from tests.reliability.live import greedy_texts

    prompts = ["def main():", "import os\n"]
    with live_server(llama_checkpoint, [*FLAGS, "--no-engine-process"],
                     tmp_path / "server.log") as live:
        assert engine_pids(live.pid) == []
        with live.http() as http:
            texts = [http.post("/v1/completions", json={
                "model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}).json()["choices"][0]["text"] for p in prompts]
    assert texts == greedy_texts(reference_llm, prompts, 12)
