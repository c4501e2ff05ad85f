"""The step loop's life: 503 while loading, and a loop that dies takes the server down loudly."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from carpool.config import EngineConfig
from carpool.engine.async_engine import AsyncEngine
from carpool.server.app import build_app
from carpool.bench.local_server import free_port


def _load_engine(checkpoint):
    from carpool.engine.llm_engine import LLMEngine
    return LLMEngine.from_config(EngineConfig.from_args(
        str(checkpoint), num_kv_blocks=64, max_model_len=128, max_num_seqs=8))


def _break_scheduler(llm_engine) -> None:
    """Inject a fault outside the step's contained part (the model call), as a bug would."""
    def broken_schedule():
        raise RuntimeError("injected scheduler fault")
    llm_engine.scheduler.schedule = broken_schedule


def _fail_next_step(llm_engine) -> None:
    def hook(scheduler_output):
        llm_engine.step_hook = None
        raise RuntimeError("injected step fault")
    llm_engine.step_hook = hook


async def _check_step_faults_fail_only_their_requests(http, engine, body) -> None:
    """A contained fault: a 500 (streaming: finish_reason "error", then an error event naming
    the fault), blocks freed."""
    await engine.call(_fail_next_step)
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 500
    error = response.json()["error"]
    assert "injected step fault" in error["message"] and error["type"] == "server_error"

    await engine.call(_fail_next_step)
    streamed = await http.post("/v1/chat/completions", json={
        **body, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    lines = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason":"error"' in lines[-3]
    assert "injected step fault" in json.loads(lines[-2][len("data: "):])["error"]["message"]

    response = await http.post("/v1/completions", json=body)  # the engine serves on
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    stats = await engine.call(lambda e: e.check_integrity() or e.stats())
    assert stats.num_free_blocks == stats.num_total_blocks


def test_health_follows_the_step_loop_from_loading_to_death(llama_checkpoint):
    fatal: list[BaseException] = []
    engine = AsyncEngine(lambda: _load_engine(llama_checkpoint), on_fatal=fatal.append)
    app = build_app(engine)
    body = {"prompt": "x = ", "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            assert (await http.get("/health")).status_code == 503  # not started: loading
            engine.start()
            await asyncio.to_thread(engine.wait_ready, 120)
            assert (await http.get("/health")).status_code == 200
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 4
            stats = await engine.call(lambda e: e.check_integrity() or e.stats())
            assert stats.num_free_blocks == stats.num_total_blocks

            await _check_step_faults_fail_only_their_requests(http, engine, body)

            await engine.call(_break_scheduler)
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 503
            assert "injected scheduler fault" in response.json()["error"]["message"]
            health = await http.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
            again = await http.post("/v1/completions", json=body)
            assert again.status_code == 503

    asyncio.run(main())
    assert len(fatal) == 1 and "injected" in str(fatal[0])
    assert not engine.is_ready


@pytest.mark.slow
def test_serve_exits_nonzero_when_the_model_cannot_load(tmp_path):
    process = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "serve", str(tmp_path / "no-such-model"),
         "--port", str(free_port()), "--log-level", "error"],
        capture_output=True, text=True, timeout=120)
    assert process.returncode == 1  # the config is resolved against the model before binding
    assert "no-such-model" in process.stderr
