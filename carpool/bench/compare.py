"""Variants side by side: a table of figures, and ratios against a baseline with their spread.

A ratio is only taken between runs of the same round (the variants run one
after another on the same requests), and rounds are repeated so the table can
say how noisy it was: min / median / max of each ratio over the rounds.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from carpool.bench.stats import BenchmarkSummary

# (label, how to read it off a summary)
FIGURES = (
    ("out tok/s", lambda s: s.output_throughput),
    ("tot tok/s", lambda s: s.total_token_throughput),
    ("mean E2E ms", lambda s: s.e2el.mean_ms),
    ("p99 E2E ms", lambda s: s.e2el.p99_ms),
    ("ITL p50 ms", lambda s: s.itl.median_ms),
    ("ITL p99 ms", lambda s: s.itl.p99_ms),
)


@dataclass(frozen=True)
class Spread:
    low: float
    median: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if not values:
            raise ValueError("Spread.of needs at least one value")
        return cls(min(values), statistics.median(values), max(values))

    def __str__(self) -> str:
        if self.low == self.high:
            return f"{self.median:.2f}"
        return f"{self.median:.2f} [{self.low:.2f}-{self.high:.2f}]"


def ratio_spreads(rounds: list[dict[str, BenchmarkSummary]],
                  baseline: str) -> dict[str, dict[str, Spread]]:
    """variant -> figure label -> spread over rounds of (variant's figure / baseline's)."""
    spreads: dict[str, dict[str, Spread]] = {}
    for variant in rounds[0]:
        if variant == baseline:
            continue
        spreads[variant] = {}
        for label, read in FIGURES:
            values = [read(r[variant]) / read(r[baseline]) for r in rounds if read(r[baseline]) > 0]
            if values:
                spreads[variant][label] = Spread.of(values)
    return spreads


def format_comparison(rounds: list[dict[str, BenchmarkSummary]], baseline: str) -> str:
    """Median of each figure per variant, then each ratio against `baseline` with its spread."""
    if not rounds:
        raise ValueError("format_comparison needs at least one round")
    variants = list(rounds[0])
    name_width = max(len(v) for v in variants) + 2
    header = f"{'variant':<{name_width}}" + "".join(f"{label:>13}" for label, _ in FIGURES)
    lines = [f"Medians over {len(rounds)} round(s)", header, "-" * len(header)]
    for variant in variants:
        cells = [statistics.median(read(r[variant]) for r in rounds) for _, read in FIGURES]
        lines.append(f"{variant:<{name_width}}" + "".join(f"{c:>13.2f}" for c in cells))
    spreads = ratio_spreads(rounds, baseline)
    if spreads:
        lines += ["", f"Ratios vs {baseline}: median [min-max] over {len(rounds)} round(s)"]
        for variant, by_label in spreads.items():
            parts = [f"{label} x{spread}" for label, spread in by_label.items()]
            lines.append(f"  {variant}: " + ", ".join(parts))
    return "\n".join(lines)


def comparison_json(rounds: list[dict[str, BenchmarkSummary]], baseline: str) -> dict:
    return {
        "baseline": baseline,
        "rounds": [{variant: s.to_dict() for variant, s in r.items()} for r in rounds],
        "ratios": {variant: {label: vars(spread) for label, spread in by_label.items()}
                   for variant, by_label in ratio_spreads(rounds, baseline).items()},
    }
