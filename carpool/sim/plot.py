"""The slot timeline as a picture: one lane per slot, static and continuous side by side.

matplotlib (Agg backend, no display) is imported only when a plot is asked for.
"""

from __future__ import annotations

from carpool.sim.simulator import SimResult

WASTE_COLOR = "#bbbbbb"


def plot_timelines(results: dict[str, SimResult], path: str) -> None:
    """Draw each scheduler's slots over time.

    White is idle, grey is an ended member still seated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    total_s = max(r.total_s for r in results.values())
    request_ids = dict.fromkeys(rid for r in results.values() for rid in r.finish_s)
    colors = {rid: f"C{i % 10}" for i, rid in enumerate(request_ids)}  # same colour in every panel
    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4), squeeze=False)
    for ax, (kind, result) in zip(axes[0], results.items()):
        _draw_lanes(ax, result, colors)
        ax.set_title(f"{kind}: total {result.total_s:.1f} s, mean latency "
                     f"{result.mean_latency_s:.1f} s")
        ax.set_xlim(0, total_s)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("slot")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _draw_lanes(ax, result: SimResult, colors: dict[str, str]) -> None:
    num_slots = len(result.steps[0].cells)
    for slot in range(num_slots):
        for holder, active, start, end in _spans(result, slot):
            if holder is None:
                continue
            ax.broken_barh([(start, end - start)], (slot - 0.4, 0.8),
                           facecolors=colors[holder] if active else WASTE_COLOR, edgecolor="white")
            if end - start > 0.04 * result.total_s:
                ax.text((start + end) / 2, slot, holder, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(num_slots))
    ax.set_ylim(-0.6, num_slots - 0.4)
    ax.invert_yaxis()


def _spans(result: SimResult, slot: int):
    """Merge consecutive steps with the same holder and state into (holder, active, start, end)."""
    spans: list[list] = []
    for step in result.steps:
        cell = step.cells[slot]
        if spans and spans[-1][0] == cell.request_id and spans[-1][1] == cell.active \
                and spans[-1][3] == step.start_s:
            spans[-1][3] = step.end_s
        else:
            spans.append([cell.request_id, cell.active, step.start_s, step.end_s])
    return spans
