"""A soak: steady mixed streaming load with random disconnects, watching memory and latency.

`soak()` keeps `concurrency` clients busy for `duration_s` seconds against a
running server; each client streams greedy completions of random prompts and
lengths, and walks away part-way through a random share of them. The
server's resident memory is sampled from /proc every second. After a
warm-up (the first third), memory must stay flat and the 99th percentile of
the gaps between stream chunks (the median over 3-second windows of each
window's p99) must hold steady between the two halves of the rest. Used by
tests/reliability (30 s) and benchmarks/features/soak.py (10 min).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

from carpool.testing.stream_load import (
    ClientPlan,
    async_client,
    percentile,
    read_rss_bytes,
    run_client,
)

SOAK_PROMPTS = ["import os\n", "class Foo:", "for i in range(", "def main():\n    ", "x = [",
                "def handler(request):\n    return request.json()\n" * 6, "# comment\n",
                "while True:\n    line = input()\n" * 3]


@dataclass
class SoakReport:
    duration_s: float
    num_requests: int = 0
    num_left: int = 0  # clients that walked away mid-response
    num_errors: int = 0
    rss_samples: list[tuple[float, int]] = field(default_factory=list)  # (t, bytes)
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (t, seconds)
    warmup_s: float = 0.0

    def _rss_median(self, start: float, end: float) -> int:
        values = [b for t, b in self.rss_samples if start <= t < end]
        return int(statistics.median(values)) if values else 0

    @property
    def rss_after_warmup(self) -> int:
        return self._rss_median(self.warmup_s, self.warmup_s + 5)

    @property
    def rss_at_end(self) -> int:
        return self._rss_median(self.duration_s - 5, self.duration_s + 60)

    @property
    def rss_growth(self) -> float:
        """Relative growth of resident memory from just after warm-up to the end."""
        return self.rss_at_end / self.rss_after_warmup - 1.0

    def p99_gap(self, start: float, end: float, window_s: float = 3.0) -> float:
        """The median over `window_s` windows of each window's p99 chunk gap: one stall of
        a shared machine moves one window, not the figure."""
        p99s = []
        t = start
        while t < end:
            gaps = [g for at, g in self.gaps if t <= at < min(t + window_s, end)]
            if gaps:
                p99s.append(percentile(gaps, 0.99))
            t += window_s
        return statistics.median(p99s)

    @property
    def p99_halves(self) -> tuple[float, float]:
        middle = (self.warmup_s + self.duration_s) / 2
        return (self.p99_gap(self.warmup_s, middle), self.p99_gap(middle, self.duration_s))

    def summary(self) -> str:
        first, second = self.p99_halves
        return (f"{self.duration_s:.0f}s soak: {self.num_requests} requests, {self.num_left} "
                f"disconnects, {self.num_errors} errors; RSS {self.rss_after_warmup / 2**20:.1f} "
                f"MiB after warm-up -> {self.rss_at_end / 2**20:.1f} MiB at the end "
                f"({100 * self.rss_growth:+.2f}%); p99 chunk gap {1000 * first:.1f} ms -> "
                f"{1000 * second:.1f} ms")


async def soak(base_url: str, api_key: str | None, model: str, pid: int, duration_s: float,
               concurrency: int = 16, leave_fraction: float = 0.3, seed: int = 0) -> SoakReport:
    report = SoakReport(duration_s, warmup_s=duration_s / 3)
    rng = random.Random(seed)
    started = time.monotonic()
    stop = started + duration_s

    async def sample_rss() -> None:
        while time.monotonic() < stop:
            report.rss_samples.append((time.monotonic() - started, read_rss_bytes(pid)))
            await asyncio.sleep(1.0)

    async def worker(http) -> None:
        while time.monotonic() < stop:
            result = await run_client(http, model, _random_plan(rng, leave_fraction))
            now = time.monotonic() - started
            report.num_requests += 1
            report.num_left += result.left
            report.num_errors += result.error is not None
            report.gaps.extend((now, gap) for gap in result.chunk_gaps[1:])

    async with async_client(base_url, api_key) as http:
        await asyncio.gather(sample_rss(), *(worker(http) for _ in range(concurrency)))
    report.rss_samples.append((time.monotonic() - started, read_rss_bytes(pid)))
    return report


def _random_plan(rng: random.Random, leave_fraction: float) -> ClientPlan:
    prompt = rng.choice(SOAK_PROMPTS)
    max_tokens = rng.randint(4, 64)
    if rng.random() >= leave_fraction:
        return ClientPlan(prompt, max_tokens)
    if rng.random() < 0.2:
        return ClientPlan(prompt, max_tokens, leave_before_headers_s=rng.uniform(0, 0.02))
    return ClientPlan(prompt, max_tokens, leave_after_chunks=rng.randint(0, max_tokens - 1))
