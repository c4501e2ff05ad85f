"""Who sat in which slot during each simulated step, and an ASCII picture of it.

Schedulers have no notion of slots (a slot is a place in the batch), so the
simulator seats each request in the lowest free slot when it is first
scheduled and frees the slot when the request ends or is preempted. The
static baseline frees its slots only when the whole batch has ended.
"""

from __future__ import annotations

from dataclasses import dataclass

from carpool.core.kv_fit import cdiv

IDLE = "."  # nobody in the slot
WASTED = "x"  # a member that already ended, still computed until its batch ends


@dataclass(frozen=True)
class Cell:
    request_id: str | None  # who holds the slot (None: idle)
    active: bool  # False for an idle slot or one held by a request that already ended


@dataclass(frozen=True)
class StepRecord:
    start_s: float
    end_s: float
    cells: tuple[Cell, ...]


class SlotTracker:
    def __init__(self, num_slots: int) -> None:
        self._seats: list[str | None] = [None] * num_slots

    def seat(self, request_ids: list[str]) -> None:
        """Give each request not yet seated the lowest free slot."""
        seated = set(self._seats)
        for request_id in request_ids:
            if request_id in seated:
                continue
            try:
                index = self._seats.index(None)
            except ValueError:
                raise RuntimeError(f"no free slot for {request_id!r}: the scheduler ran more "
                                   f"requests than {len(self._seats)} slots") from None
            self._seats[index] = request_id
            seated.add(request_id)

    def release(self, request_ids: list[str]) -> None:
        gone = set(request_ids)
        self._seats = [None if s in gone else s for s in self._seats]

    @property
    def seated_ids(self) -> list[str]:
        return [s for s in self._seats if s is not None]

    def cells(self, ended_ids: set[str]) -> tuple[Cell, ...]:
        return tuple(Cell(s, s is not None and s not in ended_ids) for s in self._seats)


def render_timeline(records: list[StepRecord], num_rows: int = 24) -> str:
    """One column per slot, one row per time bucket (the slot's holder at the bucket's start)."""
    if not records:
        return "(no steps)"
    num_slots = len(records[0].cells)
    width = max(3, max(len(c.request_id) for r in records for c in r.cells if c.request_id))
    steps_per_row = max(1, cdiv(len(records), num_rows))
    header = "   t (s) | " + " ".join(f"slot{i}".ljust(width) for i in range(num_slots))
    lines = [header, "-" * len(header)]
    for first in range(0, len(records), steps_per_row):
        record = records[first]
        row = " ".join(_cell_text(cell).ljust(width) for cell in record.cells)
        lines.append(f"{record.start_s:8.2f} | {row}")
    lines.append(f"{records[-1].end_s:8.2f} | (end)   "
                 f"[{steps_per_row} step(s) a row; '{IDLE}' idle, '{WASTED}' ended but still "
                 "seated]")
    return "\n".join(lines)


def _cell_text(cell: Cell) -> str:
    if cell.request_id is None:
        return IDLE
    return cell.request_id if cell.active else WASTED
