"""Every rank notices within seconds that another rank is gone.

Each rank runs a `Heartbeat` thread that all-reduces one number with the
others every `interval` seconds on the group's own heartbeat group. A rank
that exits or is killed closes its gloo connections, so the others' next beat
fails at once; a rank that hangs makes it time out. Either way the thread calls
`on_failure` once: rank 0 fails the engine (the server's /health turns 503 and
it exits non-zero), a worker exits, so no rank outlives the group. This covers
ranks carpool started and ranks on other machines alike, also while idle.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable

import torch

from carpool.distributed.group import TensorParallelGroup

logger = logging.getLogger(__name__)


class RankFailedError(RuntimeError):
    """Another rank of the tensor-parallel group exited, was killed or stopped answering."""


class Heartbeat:
    def __init__(self, group: TensorParallelGroup, on_failure: Callable[[RankFailedError], None],
                 *, interval: float = 1.0, timeout: float = 10.0) -> None:
        self.group = group
        self.on_failure = on_failure
        self.interval, self.timeout = interval, timeout
        self.failure: RankFailedError | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"carpool-heartbeat-{group.rank}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop beating; failures from here on are the others stopping too, not faults."""
        self._stopping.set()

    def join(self, timeout: float) -> None:
        """After `stop()`: wait for the thread to leave its last gloo call (which ends when
        the other ranks exit), so that the process never tears its groups down under it."""
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        beat = torch.zeros(1)
        timeout = datetime.timedelta(seconds=self.timeout)
        while not self._stopping.wait(self.interval):
            try:
                beat.fill_(1.0)
                self.group.heartbeat_group.allreduce([beat]).wait(timeout)
            except Exception as exc:  # noqa: BLE001 - any failure means a rank is gone
                if self._stopping.is_set():
                    return
                self.failure = RankFailedError(
                    f"{self.group.describe()}: another rank stopped answering ({exc})")
                logger.critical("%s", self.failure)
                self.on_failure(self.failure)
                return
