"""The simulator's answers as text (tables and slot timelines) or one JSON object."""

from __future__ import annotations

from carpool.sim.simulator import SimResult
from carpool.sim.timeline import render_timeline
from carpool.sim.workload import Scenario

FINISHES_PER_LINE = 8


def to_json(results: dict[str, SimResult]) -> dict:
    """`{"static": {...}, "continuous": {...}}`, seconds rounded to the millisecond."""
    return {kind: _result_json(result) for kind, result in results.items()}


def _result_json(result: SimResult) -> dict:
    return {
        "total_s": round(result.total_s, 3),
        "mean_latency_s": round(result.mean_latency_s, 3),
        "throughput_tok_s": round(result.throughput_tok_s, 3),
        "slot_utilisation": round(result.slot_utilisation, 4),
        "num_steps": result.num_steps,
        "num_preemptions": result.num_preemptions,
        "num_padding_tokens": result.num_padding_tokens,
        "requests": {rid: {"finish_s": round(finish, 3), "latency_s": round(result.latency_s[rid],
                                                                            3)}
                     for rid, finish in result.finish_s.items()},
    }


def to_text(scenario: Scenario, results: dict[str, SimResult], timeline_rows: int) -> str:
    cost = scenario.cost
    lines = [f"scenario {scenario.name}: {len(scenario.requests)} requests, "
             f"{scenario.num_output_tokens} output tokens, {scenario.num_slots} slots, "
             f"step = {cost.a * 1000:g} ms + {cost.b * 1000:g} ms x batched tokens", ""]
    for kind, result in results.items():
        lines += _result_text(kind, result, timeline_rows)
    lines.append(f"ideal bound (every slot busy every step): {scenario.ideal_seconds():.1f} s")
    if {"static", "continuous"} <= results.keys():
        speedup = results["static"].total_s / results["continuous"].total_s
        lines.append(f"continuous vs static: {speedup:.2f}x faster in total, mean latency "
                     f"{results['static'].mean_latency_s:.1f} s -> "
                     f"{results['continuous'].mean_latency_s:.1f} s")
    return "\n".join(lines)


def _result_text(kind: str, result: SimResult, timeline_rows: int) -> list[str]:
    finishes = [f"{rid} {t:.1f}" for rid, t in result.finish_s.items()]
    lines = [f"== {kind} ==",
             f"total {result.total_s:.1f} s | mean latency {result.mean_latency_s:.1f} s | "
             f"throughput {result.throughput_tok_s:.1f} tok/s | slot utilisation "
             f"{result.slot_utilisation:.0%} | {result.num_steps} steps | "
             f"{result.num_preemptions} preemptions | {result.num_padding_tokens} padding tokens",
             "finish (s):"]
    for i in range(0, len(finishes), FINISHES_PER_LINE):
        lines.append("  " + "   ".join(finishes[i:i + FINISHES_PER_LINE]))
    lines += [render_timeline(list(result.steps), timeline_rows), ""]
    return lines
