"""The front end's handle on N data-parallel engine replicas (`carpool serve -dp N`).

`DataParallelClient` offers `protocol.EngineClient` over N `EngineProcessClient`s:
each replica is its own engine-core process with its own KV pool (and its own
tensor-parallel ranks), configured as replica r of N (`EngineConfig.
data_parallel_rank`; `runner_setup.place_replica` gives it 1/N of the threads, or
its own card). Each `add` goes whole to one replica, chosen by `dp_routing.
ReplicaRouter` from the work the front end sent each replica and has not seen
finish; the stream it returns belongs to that replica, so its aborts (disconnect,
stop strings) reach that replica only. Utility calls run on every replica and
their answers are merged; the stats snapshot is the replicas' sum.

Readiness is every replica's; one replica's death is the server's (its own
streams fail, /health turns 503, `on_fatal` makes `serve` exit 1 and shut the
others down), as vLLM's data-parallel engines fail together.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from carpool.config import EngineConfig
from carpool.engine.commands import EngineSnapshot
from carpool.engine.core_client import EngineProcessClient
from carpool.engine.dp_routing import ReplicaRouter
from carpool.engine.output_stream import (
    EngineDeadError,
    EngineInfo,
    GenerationRequest,
    OutputStream,
)
from carpool.outputs import EngineStats

logger = logging.getLogger(__name__)


def replica_config(config: EngineConfig, rank: int, size: int) -> EngineConfig:
    return dataclasses.replace(config, data_parallel_size=size, data_parallel_rank=rank)


class DataParallelClient:
    """N engine-core processes behind one `EngineClient`; see the module docstring."""

    def __init__(self, config: EngineConfig, data_parallel_size: int, *,
                 log_level: str = "info",
                 metrics_factory: Callable[..., Any] | None = None,
                 on_ready: Callable[[EngineInfo], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        """`metrics_factory(info, engine=...)` makes a replica's metrics, labelled with its
        index; the replicas' metrics must share one registry (`MetricFamilies`)."""
        if data_parallel_size < 2:
            raise ValueError(f"data_parallel_size must be >= 2 for a data-parallel client, "
                             f"got {data_parallel_size}")
        self.num_replicas = data_parallel_size
        self.on_ready = on_ready
        self.on_fatal = on_fatal
        self.info: EngineInfo | None = None
        self.metrics: Any = None
        self._lock = threading.Lock()
        self._num_ready = 0
        self._fatal: BaseException | None = None
        self._router: ReplicaRouter | None = None
        self.replicas = [
            EngineProcessClient(
                replica_config(config, rank, data_parallel_size), log_level=log_level,
                metrics_factory=None if metrics_factory is None else _labelled(
                    metrics_factory, str(rank)),
                on_ready=self._replica_ready, on_fatal=self._fatal_hook(rank))
            for rank in range(data_parallel_size)]

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        for replica in self.replicas:
            replica.wait_ready(timeout)
        return self.is_ready

    @property
    def is_ready(self) -> bool:
        return self.info is not None and all(r.is_ready for r in self.replicas)

    @property
    def dead_error(self) -> BaseException | None:
        return self._fatal or next(
            (r.dead_error for r in self.replicas if r.dead_error is not None), None)

    @property
    def pids(self) -> list[int | None]:
        return [r.pid for r in self.replicas]

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every replica at once (each: Stop, then SIGKILL after `timeout`)."""
        threads = [threading.Thread(target=r.shutdown, args=(timeout,),
                                    name=f"carpool-dp-shutdown-{i}")
                   for i, r in enumerate(self.replicas)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _replica_ready(self, info: EngineInfo) -> None:
        with self._lock:
            self._num_ready += 1
            if self._num_ready < self.num_replicas:
                return
        first = self.replicas[0]
        self._router = ReplicaRouter(self.num_replicas, info.kv_cache_info["block_size"])
        self.metrics = first.metrics  # one registry: it renders every replica's series
        self.info = first.info
        for rank, replica in enumerate(self.replicas):
            logger.info("engine replica %d of %d ready: pid %s", rank, self.num_replicas,
                        replica.pid)
        if self.on_ready is not None:
            self.on_ready(self.info)

    def _fatal_hook(self, rank: int) -> Callable[[BaseException], None]:
        def on_replica_fatal(exc: BaseException) -> None:
            with self._lock:
                first = self._fatal is None
                if first:
                    self._fatal = EngineDeadError(f"engine replica {rank}: {exc}")
            if first and self.on_fatal is not None:
                self.on_fatal(self._fatal)
        return on_replica_fatal

    # ---- the event loop's side -------------------------------------------------------
    def add(self, requests: list[GenerationRequest]) -> OutputStream:
        """Queue the requests on one replica (the least loaded, or the home of their prefix);
        the stream belongs to that replica."""
        loads = [r.work.num_tokens for r in self.replicas]
        return self.replicas[self._router.choose(loads, requests)].add(requests)

    def abort(self, request_ids: list[str]) -> None:
        for replica in self.replicas:
            held = [rid for rid in request_ids if replica.work.holds(rid)]
            if held:
                replica.abort(held)

    def set_paused(self, request_ids: list[str], paused: bool) -> None:
        """Flow control, forwarded like `abort` (a stream pauses through its own replica)."""
        for replica in self.replicas:
            held = [rid for rid in request_ids if replica.work.holds(rid)]
            if held:
                replica.set_paused(held, paused)

    def snapshot(self) -> EngineSnapshot | None:
        """The replicas' latest snapshots summed (None while any is loading)."""
        snapshots = [r.snapshot() for r in self.replicas]
        if any(s is None for s in snapshots):
            return None
        return EngineSnapshot(merge_stats([s.stats for s in snapshots]),
                              max(s.time for s in snapshots),
                              sum(s.num_requests_taken for s in snapshots))

    async def call_utility(self, name: str, *args) -> Any:
        """Run the utility on every replica; their results merged (`merge_results`)."""
        results = await asyncio.gather(*(r.call_utility(name, *args) for r in self.replicas))
        return merge_results(list(results))


def _labelled(factory: Callable[..., Any], engine: str) -> Callable[[EngineInfo], Any]:
    return lambda info: factory(info, engine=engine)


def merge_stats(stats: list[EngineStats]) -> EngineStats:
    """Every count summed (per position for a tuple of counts, per adapter for a dict of
    them; max_lora is each replica's); the KV cache usage of the pooled blocks."""
    total = {f.name: _merged([getattr(s, f.name) for s in stats])
             for f in dataclasses.fields(EngineStats) if f.name not in ("kv_cache_usage",
                                                                           "max_lora")}
    total["max_lora"] = max((s.max_lora for s in stats), default=0)
    num_total = total["num_total_blocks"]
    usage = 1.0 - total["num_free_blocks"] / num_total if num_total else 0.0
    return EngineStats(**total, kv_cache_usage=usage)


def _merged(values: list) -> Any:
    if not values or values[0] is None:  # e.g. router_load when not counted
        return values[0] if values else 0
    if isinstance(values[0], dict):
        merged: dict = {}
        for value in values:
            for key, count in value.items():
                merged[key] = merged.get(key, 0) + count
        return merged
    if isinstance(values[0], (tuple, list)):  # per position (router_load: per layer, too)
        width = max(len(v) for v in values)
        return tuple(_merged([v[i] for v in values if i < len(v)]) for i in range(width))
    return sum(values)


def merge_results(results: list[Any]) -> Any:
    """A utility's per-replica answers as one: numbers summed; stats dicts summed, with the
    integrity verdict "ok" only if every replica's is, and each replica's under "engines"."""
    if all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in results):
        return sum(results)
    if all(isinstance(r, dict) for r in results):
        names = {f.name for f in dataclasses.fields(EngineStats)}
        merged = merge_stats([EngineStats(**{k: v for k, v in r.items() if k in names})
                              for r in results]).as_dict()
        verdicts = [r.get("integrity") for r in results]
        if any(v is not None for v in verdicts):
            merged["integrity"] = "ok" if all(v == "ok" for v in verdicts) else "; ".join(
                f"engine {i}: {v}" for i, v in enumerate(verdicts) if v != "ok")
        return {**merged, "engines": results}
    return results
