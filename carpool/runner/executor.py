"""What the engine runs its steps through: one `ModelRunner`, or rank 0 of a tensor-parallel
group (`TensorParallelExecutor`), which shows the engine the same surface.

Both have `close()`; the engine calls it once when it stops (a lone runner holds no
processes, so for it this does nothing).
"""

from __future__ import annotations

from pathlib import Path

from carpool.config import EngineConfig
from carpool.distributed import RankFailedError
from carpool.runner.model_runner import ModelRunner

__all__ = ["RankFailedError", "create_executor"]


def create_executor(config: EngineConfig, model_path: str | Path):
    """A `ModelRunner` for one rank; else a `TensorParallelExecutor` that spawns ranks 1..N-1
    here (no `distributed_init_method`) or meets them through it. `config` is resolved
    (`runner_setup.resolve_for_model`) and `model_path` its model's folder."""
    if config.tensor_parallel_size == 1 and config.distributed_init_method is None:
        return ModelRunner(config, model_path)
    from carpool.runner.tp_executor import TensorParallelExecutor
    return TensorParallelExecutor(config, model_path)
