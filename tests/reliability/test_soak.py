"""Soak: mixed streaming load with random disconnects; memory flat, p99 steady, nothing leaked.

`CARPOOL_SOAK_SECONDS` sets the length (CI: 30 s); `benchmarks/features/soak.py` runs
the full 10 minutes and prints the same figures.
"""

from __future__ import annotations

import pytest

import asyncio
import os

from carpool.testing.soak import soak
from tests.reliability.live import API_KEY, MODEL, live_server, wait_idle_and_intact

pytestmark = pytest.mark.slow  # a live server (still run in CI)

SOAK_FLAGS = ["--max-num-seqs", "16", "--num-kv-blocks", "256", "--max-model-len", "256",
              "--max-num-batched-tokens", "128"]


def test_soak_memory_flat_latency_steady_no_leaks(llama_checkpoint, tmp_path):
    duration_s = float(os.environ.get("CARPOOL_SOAK_SECONDS", "30"))
    with live_server(llama_checkpoint, SOAK_FLAGS, tmp_path / "server.log") as live:
        report = asyncio.run(soak(live.base_url, API_KEY, MODEL, live.pid, duration_s,
                                  concurrency=16, seed=7))
        stats = wait_idle_and_intact(live)
    print("\n" + report.summary())
    assert report.num_requests > 50 and report.num_left > 5
    assert report.num_errors == 0
    assert report.rss_growth < 0.05, report.summary()
    first, second = report.p99_halves
    # Steady, loosely: the machine is shared, so only a collapse (3x) counts as unstable.
    assert second < 3 * first + 0.05, report.summary()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
