"""Hundreds of streaming clients, a random half walking away: nothing leaks, the rest are right.

Clients leave before the response headers, right after them (for the long
prompts that is during their chunked prefill), or part-way through the
stream. Afterwards the engine is idle with every KV block free — by the
block manager's own integrity check and by /metrics — and every client that
stayed got the complete greedy completion `LLM.generate` gives.
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from carpool.testing.stream_load import async_client, plan_clients, run_client
from tests.reliability.live import (API_KEY, MODEL, greedy_texts, live_server, metric_value,
                                        wait_idle_and_intact)

pytestmark = pytest.mark.slow  # a live server (still run in CI)

# Chunked prefill in 64-token steps, so a long prompt takes several steps to prefill. A small
# send buffer, so a leaver's socket fills (and its request pauses until its departure is
# noticed) after a few dozen chunks rather than after the whole of its reply.
STORM_FLAGS = ["--max-num-seqs", "32", "--num-kv-blocks", "512", "--max-model-len", "512",
               "--max-num-batched-tokens", "64", "--max-num-waiting-requests", "1024",
               "--log-prompts", "--http-send-buffer", "4096"]
LONG = "def handler(request):\n    return request.json()\n" * 14  # ~300 tokens
PROMPTS = ["import os\n", "class Foo:", LONG, "for i in range(", "def main():", "x = [",
           LONG + "# tail\n", "return "]
MAX_TOKENS = 24
# Leavers ask for more than the at most MAX_TOKENS chunks they read: a 24-token request can be
# complete in the engine before its client's departure is noticed (the tiny model is fast),
# which once left a whole storm with nothing to abort.
LEAVER_MAX_TOKENS = 160


def num_storm_clients() -> int:
    return int(os.environ.get("CARPOOL_STORM_CLIENTS", "200"))


@pytest.fixture(scope="module")
def storm_server(llama_checkpoint, tmp_path_factory):
    with live_server(llama_checkpoint, STORM_FLAGS,
                     tmp_path_factory.mktemp("storm") / "server.log") as live:
        yield live


def _finished(live, reason: str) -> float:
    with live.http() as http:
        return metric_value(http.get("/metrics").text, "carpool:request_success_total",
                            finished_reason=reason)


def test_disconnect_storm_leaks_nothing_and_the_rest_are_complete(storm_server, reference_llm):
    num_clients = num_storm_clients()
    plans = plan_clients(random.Random(1234), num_clients, PROMPTS, MAX_TOKENS,
                         leaver_max_tokens=LEAVER_MAX_TOKENS)
    aborts_before = _finished(storm_server, "abort")

    async def storm():
        async with async_client(storm_server.base_url, API_KEY) as http:
            return await asyncio.gather(*(run_client(http, MODEL, p) for p in plans))

    results = asyncio.run(storm())
    stats = wait_idle_and_intact(storm_server)
    expected = dict(zip(PROMPTS, greedy_texts(reference_llm, PROMPTS, MAX_TOKENS)))
    stayers = [r for r in results if not r.plan.leaves]
    leavers = [r for r in results if r.plan.leaves]
    assert len(leavers) >= num_clients // 3 and len(stayers) >= num_clients // 3
    for r in stayers:
        assert r.status == 200 and r.error is None, (r.status, r.error)
        assert r.finish_reasons == ["length"]
        assert r.text == expected[r.plan.prompt]
    for r in leavers:  # the leavers' requests were valid: any answer they read was a 200
        assert r.status in (None, 200) and (r.error is None or r.left), (r.status, r.error)
    num_left = sum(r.left for r in leavers)
    num_aborted = _finished(storm_server, "abort") - aborts_before
    assert num_left >= len(leavers) // 2  # most really left mid-response
    assert 0 < num_aborted <= len(leavers)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    print(f"\nstorm: {num_clients} clients, {len(leavers)} leavers ({num_left} left mid-response, "
          f"{int(num_aborted)} aborted in the engine), {len(stayers)} complete; "
          f"{stats['num_total_blocks'] - stats['num_free_blocks']} blocks held afterwards")


def test_log_prompts_puts_prompts_in_the_request_log(storm_server):
    """The storm server runs with --log-prompts (test_security checks the default: never)."""
    marker = "logged-prompt-51c2e8"
    with storm_server.http() as http:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": marker,
                                                      "max_tokens": 2})
    assert response.status_code == 200
    assert repr(marker) in storm_server.log()
