"""Rank 0 of a tensor-parallel group: the engine's runner, driving the other ranks.

    engine ── execute(step) ──> TensorParallelExecutor ── broadcast(step) ──> ranks 1..N-1
                                      │ its own ModelRunner (rank 0's shard)      │ ModelRunner
                                      └──────── all-reduce / gather in every layer ┘
                                      rank 0 samples; the engine gets its tokens

It has `ModelRunner`'s surface (`execute`, `model_config`, `num_kv_blocks`,
`kv_cache_info`, `attention`), so the engine does not know how many ranks there are.
Each step's `SchedulerOutput` goes to the workers as int64s holding only what a
forward needs (`step_message`).

With no `init_method` it starts ranks 1..N-1 on this machine (torch.multiprocessing,
spawn, daemon processes) and rendezvous with them on a free loopback port. With
one (`env://`), the other ranks were started elsewhere (`carpool tp-worker`).

A failed rank is fatal: ranks run the same collectives in the same order, so after
any error inside a step, or a failed heartbeat, the group cannot go on. `execute`
then raises `RankFailedError`, which the engine does not contain, and
`on_failure` (set by whoever drives the engine) hears of a failure at once, also
while idle.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from carpool.config import EngineConfig
from carpool.core.scheduler_output import SchedulerOutput
from carpool.distributed import Heartbeat, RankFailedError, join_group, local_init_method
from carpool.runner.model_runner import ModelRunner, ModelRunnerOutput
from carpool.runner.step_message import encode_shutdown, encode_step
from carpool.runner.tp_worker import WorkerSpec, on_device, rank_device, spawned_worker_main
from carpool.structured.speculation import StepGrammar

logger = logging.getLogger(__name__)

# How long spawned ranks get to start Python and torch and join the rendezvous.
SPAWN_JOIN_TIMEOUT_S = 300.0
SHUTDOWN_JOIN_TIMEOUT_S = 10.0


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig, model_path: str | Path) -> None:
        """Start or meet the ranks of `config` (resolved: `runner_setup.resolve_for_model`),
        then load rank 0's shard of the model in `model_path`."""
        self.tensor_parallel_size = config.tensor_parallel_size
        self.on_failure: Callable[[RankFailedError], None] | None = None
        self.failure: RankFailedError | None = None
        self._closed = False
        self._processes: list[mp.Process] = []
        device = rank_device(config, 0)
        init_method = config.distributed_init_method
        spawn = init_method is None
        init_method = local_init_method() if spawn else init_method
        try:
            if spawn:
                self._spawn(config, str(model_path), init_method)
            group = self._join(init_method, device, rank=0 if spawn else None)
            if group.rank != 0:
                raise ValueError(f"this process joined {init_method} as rank {group.rank}; "
                                 "only rank 0 runs the engine (start the others with "
                                 "`carpool tp-worker`)")
            self.group = group
            self._heartbeat = Heartbeat(group, on_failure=self._fail)
            self._heartbeat.start()
            self._finalizer = weakref.finalize(self, _stop_quietly, self._heartbeat,
                                               self._processes)
            self.runner = ModelRunner(on_device(config, device), model_path, tp=group)
        except BaseException:
            self.close()
            raise
        logger.info("tensor parallel: %d ranks, %s backend, %s", self.tensor_parallel_size,
                    group.backend, "spawned on this machine" if spawn else init_method)

    # ---- ModelRunner's surface ----------------------------------------------------------
    @property
    def model_config(self):
        return self.runner.model_config

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks

    @property
    def kv_cache_info(self) -> dict:
        return self.runner.kv_cache_info

    @property
    def attention(self):
        return self.runner.attention

    def router_load(self) -> tuple[tuple[int, ...], ...] | None:
        return self.runner.router_load()

    def execute(self, scheduler_output: SchedulerOutput,
                grammar: StepGrammar | None = None) -> ModelRunnerOutput:
        """Broadcast the step, run rank 0's shard, sample (with the grammar masks: rank 0
        alone samples). Raises RankFailedError if the group is broken (before or during
        the step)."""
        if self.failure is not None:
            raise self.failure
        if scheduler_output.is_empty:  # nothing to run: only rank 0's sampler state changes
            return self.runner.execute(scheduler_output, grammar)
        try:
            self.group.broadcast_ints(encode_step(scheduler_output))
            return self.runner.execute(scheduler_output, grammar)
        except Exception as exc:
            failure = self.failure or RankFailedError(
                f"tensor-parallel step failed on rank 0, the ranks are out of step: {exc!r}")
            self._fail(failure)
            raise failure from exc

    def close(self) -> None:
        """Tell every rank to exit and wait for the ones this executor started (idempotent)."""
        if self._closed:
            return
        self._closed = True
        heartbeat = getattr(self, "_heartbeat", None)
        if heartbeat is not None:
            heartbeat.stop()
        if self.failure is None and getattr(self, "runner", None) is not None:
            try:
                self.group.broadcast_ints(encode_shutdown())
            except Exception:  # noqa: BLE001 - the processes are ended below anyway
                logger.warning("could not tell the tensor-parallel ranks to shut down")
        _join_or_kill(self._processes, SHUTDOWN_JOIN_TIMEOUT_S)
        if heartbeat is not None:
            heartbeat.join(SHUTDOWN_JOIN_TIMEOUT_S)
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()

    # ---- start-up and failure -----------------------------------------------------------
    def _spawn(self, config: EngineConfig, model_path: str, init_method: str) -> None:
        context = mp.get_context("spawn")
        for rank in range(1, self.tensor_parallel_size):
            spec = WorkerSpec(rank=rank, init_method=init_method, config=config,
                              model_path=model_path,
                              num_threads=torch.get_num_threads(),
                              log_level=logging.getLogger("carpool").getEffectiveLevel())
            process = context.Process(target=spawned_worker_main, args=(spec,), daemon=True,
                                      name=f"carpool-tp-rank-{rank}")
            process.start()
            self._processes.append(process)

    def _join(self, init_method: str, device: torch.device, rank: int | None):
        """join_group, but give up at once if a rank this executor spawned exits first."""
        if not self._processes:
            return join_group(init_method, self.tensor_parallel_size, device, rank=rank)
        result: dict[str, Any] = {}

        def join() -> None:
            try:
                result["group"] = join_group(init_method, self.tensor_parallel_size, device,
                                             rank=rank)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                result["error"] = exc

        thread = threading.Thread(target=join, daemon=True, name="carpool-tp-join")
        thread.start()
        sentinels = [p.sentinel for p in self._processes]
        deadline = SPAWN_JOIN_TIMEOUT_S
        while thread.is_alive() and deadline > 0:
            if multiprocessing.connection.wait(sentinels, timeout=0.2):
                dead = [p for p in self._processes if not p.is_alive()]
                raise RankFailedError(f"tensor-parallel rank(s) {[p.name for p in dead]} exited "
                                      f"(codes {[p.exitcode for p in dead]}) before joining")
            deadline -= 0.2
        if "error" in result:
            raise result["error"]
        if "group" not in result:
            raise RankFailedError(f"tensor-parallel ranks did not join within "
                                  f"{SPAWN_JOIN_TIMEOUT_S:.0f}s")
        return result["group"]

    def _fail(self, failure: RankFailedError) -> None:
        if self.failure is None:
            self.failure = failure
            if self.on_failure is not None:
                self.on_failure(failure)


def _join_or_kill(processes: list, timeout: float) -> None:
    for process in processes:
        process.join(timeout)
    for process in processes:
        if process.is_alive():
            logger.warning("%s did not exit; killing it", process.name)
            process.kill()
            process.join(1.0)


def _stop_quietly(heartbeat: Heartbeat, processes: list) -> None:
    """The executor was dropped without `close()`: end its ranks without a word."""
    heartbeat.stop()
    for process in processes:
        if process.is_alive():
            process.kill()
