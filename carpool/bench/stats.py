"""Latency and throughput figures from per-request timings, shared by every benchmark.

Each benchmark, whether it talks HTTP or drives the engine in-process, reduces a
request to a `RequestResult`: when it started, when each output chunk arrived,
and how many tokens went in and came out. `summarize` turns a list of them into
the figures `vllm bench serve` prints (TTFT, TPOT, ITL, E2E as mean / median /
p99, throughput, goodput under an SLO) plus the p99/p50 ratio that says how
long the tail is, and the peak number of requests in flight at once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")  # milliseconds, as in `vllm bench serve --goodput`


@dataclass
class RequestResult:
    """One request's timings, in seconds on a single monotonic clock."""

    start_time: float  # when the request was sent / added
    num_prompt_tokens: int
    success: bool = True
    error: str | None = None
    num_output_tokens: int = 0
    # Arrival time of every output chunk that carried tokens; the first is the TTFT mark.
    chunk_times: list[float] = field(default_factory=list)
    end_time: float | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start_time if self.chunk_times else None

    @property
    def e2el(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.start_time

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive output chunks."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for a single-token output."""
        if self.num_output_tokens < 2 or self.e2el is None or self.ttft is None:
            return None
        return (self.e2el - self.ttft) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class Distribution:
    """Mean / median / p99 of one latency, in milliseconds."""

    mean_ms: float
    median_ms: float
    p99_ms: float

    @property
    def p99_over_p50(self) -> float | None:
        """How long the tail is; None when there is no median to divide by."""
        return self.p99_ms / self.median_ms if self.median_ms > 0 else None

    @classmethod
    def of(cls, seconds: list[float]) -> Distribution:
        if not seconds:
            return cls(0.0, 0.0, 0.0)
        ms = np.asarray(seconds, dtype=float) * 1000.0
        return cls(float(ms.mean()), float(np.median(ms)), float(np.percentile(ms, 99)))


@dataclass(frozen=True)
class BenchmarkSummary:
    num_completed: int
    num_failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    output_throughput: float  # tok/s
    total_token_throughput: float  # (input + output) tok/s
    peak_concurrency: int
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    goodput: float | None = None  # req/s meeting every SLO, when SLOs were given

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("ttft", "tpot", "itl", "e2el"):
            d[name]["p99_over_p50"] = getattr(self, name).p99_over_p50
        return d


def parse_slo(text: str) -> dict[str, float]:
    """`ttft=500,tpot=50` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo: expected KEY=MS with KEY one of {SLO_KEYS}, got {part!r}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--slo: {key} must be a number of milliseconds, "
                             f"got {value!r}") from None
        if slos[key] <= 0:
            raise ValueError(f"--slo: {key} must be > 0 ms, got {value!r}")
    if not slos:
        raise ValueError("--slo: give at least one of ttft=MS, tpot=MS, e2el=MS")
    return slos


def peak_concurrency(results: list[RequestResult]) -> int:
    """Most requests in flight at one instant (a sweep over start / end events)."""
    events = []
    for r in results:
        if r.end_time is not None:
            events.append((r.start_time, 1))
            events.append((r.end_time, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # an end at t frees its place before a start at t
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def meets_slo(result: RequestResult, slos: dict[str, float]) -> bool:
    values_ms = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.e2el}
    for key, limit_ms in slos.items():
        value = values_ms[key]
        if value is not None and value * 1000.0 > limit_ms:
            return False
    return True


def summarize(results: list[RequestResult], duration_s: float,
              slos: dict[str, float] | None = None) -> BenchmarkSummary:
    """Reduce per-request results to the printed figures."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in results if r.success]
    input_tokens = sum(r.num_prompt_tokens for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    goodput = None
    if slos:
        goodput = sum(meets_slo(r, slos) for r in done) / duration_s
    return BenchmarkSummary(
        num_completed=len(done), num_failed=len(results) - len(done), duration_s=duration_s,
        total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        request_throughput=len(done) / duration_s, output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        peak_concurrency=peak_concurrency(done),
        ttft=Distribution.of([r.ttft for r in done if r.ttft is not None]),
        tpot=Distribution.of([r.tpot for r in done if r.tpot is not None]),
        itl=Distribution.of([gap for r in done for gap in r.itls]),
        e2el=Distribution.of([r.e2el for r in done if r.e2el is not None]),
        goodput=goodput)


_WIDTH = 50
_SECTIONS = (("ttft", "TTFT", "Time to First Token"),
             ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
             ("itl", "ITL", "Inter-token Latency"),
             ("e2el", "E2EL", "End-to-end Latency"))


def format_summary(summary: BenchmarkSummary, title: str = "Serving Benchmark Result",
                   num_steps: int | None = None) -> str:
    """The summary as the aligned text block `vllm bench serve` users know; offline runs
    add the number of model steps they took (`num_steps`)."""
    lines = [f" {title} ".center(_WIDTH, "=")]

    def row(label: str, value) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:>10}")

    row("Successful requests:", summary.num_completed)
    if summary.num_failed:
        row("Failed requests:", summary.num_failed)
    row("Benchmark duration (s):", summary.duration_s)
    row("Total input tokens:", summary.total_input_tokens)
    row("Total generated tokens:", summary.total_output_tokens)
    row("Request throughput (req/s):", summary.request_throughput)
    if summary.goodput is not None:
        row("Request goodput (req/s):", summary.goodput)
    row("Output token throughput (tok/s):", summary.output_throughput)
    row("Total token throughput (tok/s):", summary.total_token_throughput)
    row("Peak concurrent requests:", summary.peak_concurrency)
    if num_steps is not None:
        row("Model steps:", num_steps)
    for key, short, long in _SECTIONS:
        dist: Distribution = getattr(summary, key)
        lines.append(f" {long} ".center(_WIDTH, "-"))
        row(f"Mean {short} (ms):", dist.mean_ms)
        row(f"Median {short} (ms):", dist.median_ms)
        row(f"P99 {short} (ms):", dist.p99_ms)
        ratio = dist.p99_over_p50
        row(f"P99/P50 {short}:", "n/a" if ratio is None else ratio)
    lines.append("=" * _WIDTH)
    return "\n".join(lines)
