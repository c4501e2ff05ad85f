"""A tensor-parallel rank other than 0: load its shard, then run every step rank 0 broadcasts.

Rank 0 (the engine's `TensorParallelExecutor`) sends each step's `SchedulerOutput`
and the worker runs the same forward on its shard: the model's all-reduces and
the logits gather pair up with rank 0's, rank 0 samples. A shutdown message
(`step_message`) ends the loop (exit 0). A worker never outlives its group: when
rank 0 goes away the heartbeat fails and the worker exits 1; a worker carpool
spawned also asks the kernel to kill it with its parent (Linux `PR_SET_PDEATHSIG`).

Ranks carpool starts on this machine run `spawned_worker_main` (torch.multiprocessing,
spawn). A rank on another machine runs `carpool tp-worker`, which joins through
`env://` and calls `run_worker_rank` the same way.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch

from carpool.config import EngineConfig
from carpool.distributed import Heartbeat, TensorParallelGroup, join_group
from carpool.runner.model_runner import ModelRunner
from carpool.runner.step_message import decode_step
from carpool.utils.device import device_for_rank, resolve_device

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a spawned rank needs (pickled across the spawn)."""

    rank: int
    init_method: str  # a loopback tcp:// address rank 0 chose
    config: EngineConfig  # rank 0's, resolved; its device is rank 0's
    model_path: str
    num_threads: int  # rank 0's torch thread count: ranks split the cores alike
    log_level: int


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device of rank `rank` of the group whose rank 0 runs on `config.device`."""
    return device_for_rank(resolve_device(config.device), rank)


def on_device(config: EngineConfig, device: torch.device) -> EngineConfig:
    """`config` for the rank that runs on `device`."""
    return dataclasses.replace(config, device=str(device))


def spawned_worker_main(spec: WorkerSpec) -> None:
    """Entry point of a rank carpool spawned on this machine."""
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s [rank {spec.rank}] %(name)s: "
                               "%(message)s")
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    torch.set_num_threads(spec.num_threads)
    device = rank_device(spec.config, spec.rank)
    group = join_group(spec.init_method, spec.config.tensor_parallel_size, device,
                       rank=spec.rank)
    run_worker_rank(group, on_device(spec.config, device), spec.model_path)


def join_and_run(config: EngineConfig, model_path) -> NoReturn:
    """Entry point of a rank started by its own command (`carpool tp-worker`): join through
    `config.distributed_init_method` (the rank comes from the rendezvous), then serve steps
    until the process ends (`run_worker_rank`). `config` is resolved, as rank 0's."""
    init_method = config.distributed_init_method
    device = resolve_device(config.device)
    group = join_group(init_method, config.tensor_parallel_size, device)
    if group.rank == 0:
        raise ValueError(f"this process joined {init_method} as rank 0, which runs the engine "
                         "(`carpool serve` or `carpool generate`); workers need RANK >= 1")
    run_worker_rank(group, on_device(config, device_for_rank(device, group.rank)), model_path)


def run_worker_rank(group: TensorParallelGroup, config: EngineConfig, model_path) -> NoReturn:
    """Load this rank's shard and run steps until rank 0 says shut down; the process then
    exits 0 (1 on any failure). It ends without the interpreter's teardown: the heartbeat
    thread may still be inside a gloo call, and destroying the groups under it aborts."""
    heartbeat = Heartbeat(group, on_failure=lambda _error: _exit_now(1))
    heartbeat.start()
    try:
        runner = ModelRunner(config, model_path, tp=group)
        while True:
            step = decode_step(group.broadcast_ints())
            if step is None:
                break
            runner.execute(step)
    except Exception:
        logger.exception("%s failed; exiting", group.describe())
        _exit_now(1)
    heartbeat.stop()
    logger.info("%s: shut down by rank 0", group.describe())
    _exit_now(0)


def _exit_now(code: int) -> NoReturn:
    """End the process at once (nothing a rank holds needs saving), logs flushed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (rank 0) dies, however it dies."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # elsewhere the heartbeat still ends the worker
