"""Pictures of a run: who held which batch slot at each step, and what each step computed.

The slot timeline gives every request a coloured bar on one lane (batch slot)
from the step it was first scheduled to the step it finished. Under static
batching a lane stays grey (idle) from the moment its request ends until the
whole batch has ended — the convoy — while under continuous batching a waiting
request takes the lane on the next step. The tokens plot stacks each step's
prefill and decode tokens: without chunked prefill a long prompt shows as one
tall spike that every decode waits behind; with it the prompt is spread over
several steps capped at the budget.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from carpool.bench.offline import OfflineRun

_IDLE_COLOUR = "#e6e6e6"
_PREFILL_COLOUR = "#d95f02"
_DECODE_COLOUR = "#1b9e77"


@dataclass(frozen=True)
class SlotSpan:
    lane: int
    first_step: int  # inclusive
    last_step: int  # inclusive
    request_index: int


def slot_spans(run: OfflineRun) -> list[SlotSpan]:
    """Each request's [first, last] step on the lowest lane free at its first step."""
    intervals = sorted((first, last, i) for i, (first, last) in enumerate(run.request_steps))
    free_lanes: list[int] = []
    busy: list[tuple[int, int]] = []  # (last_step, lane)
    spans, num_lanes = [], 0
    for first, last, index in intervals:
        while busy and busy[0][0] < first:
            heapq.heappush(free_lanes, heapq.heappop(busy)[1])
        if free_lanes:
            lane = heapq.heappop(free_lanes)
        else:
            lane, num_lanes = num_lanes, num_lanes + 1
        heapq.heappush(busy, (last, lane))
        spans.append(SlotSpan(lane, first, last, index))
    return spans


def draw_slot_timeline(ax, run: OfflineRun, num_steps: int) -> None:
    spans = slot_spans(run)
    num_lanes = max((s.lane for s in spans), default=-1) + 1
    cmap = _colour_map()
    for lane in range(num_lanes):
        ax.broken_barh([(0, len(run.steps))], (lane + 0.1, 0.8), facecolors=_IDLE_COLOUR)
    for span in spans:
        ax.broken_barh([(span.first_step, span.last_step - span.first_step + 1)],
                       (span.lane + 0.1, 0.8),
                       facecolors=cmap(span.request_index % cmap.N), edgecolor="white",
                       linewidth=0.3)
    ax.set_xlim(0, num_steps)
    ax.set_ylim(0, max(num_lanes, 1))
    ax.yaxis.set_major_locator(_integer_locator())
    ax.set_ylabel("batch slot")
    unit = "s" if run.clock == "wall" else "CPU s"
    ax.set_title(f"{run.variant}: {len(run.steps)} steps, {run.duration_s:.1f} {unit}")


def draw_tokens_per_step(ax, run: OfflineRun, num_steps: int) -> None:
    """Stacked outlines rather than bars, so a one-step spike among hundreds still shows."""
    import numpy as np

    prefill = np.array([s.num_prefill_tokens for s in run.steps], dtype=float)
    total = prefill + np.array([s.num_decode_tokens for s in run.steps], dtype=float)
    edges = np.arange(len(run.steps) + 1)
    ax.stairs(total, edges, fill=True, color=_DECODE_COLOUR, label="decode tokens")
    ax.stairs(prefill, edges, fill=True, color=_PREFILL_COLOUR, label="prefill tokens")
    ax.stairs(prefill, edges, color=_PREFILL_COLOUR, linewidth=1.0)
    ax.set_xlim(0, num_steps)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens in step")
    ax.legend(loc="upper right", fontsize="small")


def save_comparison_plot(path: str, runs: list[OfflineRun]) -> None:
    """One column per run: slot timeline above, batched tokens per step below; same step axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("save_comparison_plot needs at least one run")
    num_steps = max(len(r.steps) for r in runs)
    fig, axes = plt.subplots(2, len(runs), figsize=(4.5 * len(runs), 6), squeeze=False,
                             gridspec_kw={"height_ratios": [2, 1]})
    max_tokens = max((s.num_prefill_tokens + s.num_decode_tokens for r in runs for s in r.steps),
                     default=1)
    for column, run in enumerate(runs):
        draw_slot_timeline(axes[0][column], run, num_steps)
        draw_tokens_per_step(axes[1][column], run, num_steps)
        # one scale, so a tall prefill spike shows as one
        axes[1][column].set_ylim(0, max_tokens * 1.05)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _integer_locator():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _colour_map():
    import matplotlib

    return matplotlib.colormaps["tab20"]
