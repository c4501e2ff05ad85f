"""Whether the engine is stalled: it has work but has finished no step for a while.

A stopped engine process (SIGSTOP, a debugger, swap) or one stuck in a long grammar
compile still has a live pipe, so nothing else notices; without this /health stays 200
and a router keeps sending it traffic. Every step the engine finishes publishes a
snapshot stamped with `time.monotonic()` (one clock for all processes of the machine);
the engine *has work* when that snapshot shows running or waiting requests that are not
paused, or when the front end sent requests the snapshot has not taken in yet. Stalled
for = now - the later of the snapshot's time and the oldest such send (so an engine that
sat idle is not blamed for the idle time). With data parallelism the replicas' merged
snapshot counts: the server is stalled when none of them steps.
"""

from __future__ import annotations

import time

from carpool.engine.protocol import EngineClient
from carpool.server.admission import Admission


def stalled_for(engine: EngineClient, admission: Admission, now: float | None = None) -> float:
    """Seconds the engine has had work without finishing a step (0 when it has none)."""
    snapshot = engine.snapshot()
    if snapshot is None:
        return 0.0
    now = time.monotonic() if now is None else now
    stats = snapshot.stats
    since = snapshot.time
    if stats.num_running + stats.num_waiting <= stats.num_paused:
        untaken = admission.oldest_untaken_send(snapshot.num_requests_taken)
        if untaken is None:
            return 0.0
        since = max(since, untaken)
    return max(now - since, 0.0)


def stall_message(engine: EngineClient, admission: Admission, timeout: float) -> str | None:
    """Why the engine counts as stalled under `timeout` seconds (0: never), or None."""
    if timeout <= 0:
        return None
    seconds = stalled_for(engine, admission)
    if seconds < timeout:
        return None
    return (f"The engine has had work but finished no step for {seconds:.0f}s "
            f"(--engine-stall-timeout {timeout:g}s).")
