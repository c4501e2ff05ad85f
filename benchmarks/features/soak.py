"""Soak a real `carpool serve` with mixed streaming load and random disconnects; print figures.

    python3 -m benchmarks.features.soak --seconds 600            # the recorded 10-minute run
    python3 -m benchmarks.features.soak --seconds 60 --model PATH

Without --model it builds the tiny random Llama checkpoint the tests use. It
prints requests, disconnects, errors, resident memory after warm-up and at
the end (growth must stay under 5%), the p99 gap between stream chunks in
the two halves after warm-up, and the KV blocks still held once idle
(/stats?integrity=true runs the block manager's own check).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from carpool.bench.local_server import LocalServer
from carpool.testing.soak import soak

API_KEY = "soak-key"
MODEL = "soak-model"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--clients", type=int, default=16, help="Concurrent streaming clients.")
    parser.add_argument("--model", default=None, help="Checkpoint folder (default: tiny Llama).")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or _tiny_checkpoint(Path(tmp))
        flags = ["--served-model-name", MODEL, "--api-key", API_KEY, "--max-num-seqs", "16",
                 "--num-kv-blocks", "256", "--max-model-len", "256",
                 "--max-num-batched-tokens", "128", "--log-level", "warning"]
        local = LocalServer(model, flags, Path(tmp) / "server.log")
        with local as base_url:
            report = asyncio.run(soak(base_url, API_KEY, MODEL, local.process.pid, args.seconds,
                                      concurrency=args.clients, seed=args.seed))
            stats = _idle_stats(base_url)
    print(report.summary())
    step = max(1, len(report.rss_samples) // 12)
    print("RSS (s: MiB): " + ", ".join(f"{t:.0f}: {b / 2**20:.1f}"
                                        for t, b in report.rss_samples[::step]))
    leaked = stats["num_total_blocks"] - stats["num_free_blocks"]
    print(f"blocks leaked: {leaked} (integrity: {stats['integrity']}); "
          f"clients: {args.clients}; RSS growth {100 * report.rss_growth:+.2f}%")
    ok = leaked == 0 and stats["integrity"] == "ok" and report.rss_growth < 0.05
    return 0 if ok and report.num_errors == 0 else 1


def _tiny_checkpoint(folder: Path) -> str:
    from carpool.testing.checkpoints import build_checkpoint
    return str(build_checkpoint(folder / "tiny-llama", "llama"))


def _idle_stats(base_url: str, timeout: float = 60.0) -> dict:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{base_url}/stats", params={"integrity": "true"}, headers=headers,
                          timeout=30).json()
        if (stats["num_running"] == 0 and stats["num_waiting"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
