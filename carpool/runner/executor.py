"""What the engine runs its steps through: one `ModelRunner`, or rank 0 of a tensor-parallel
group (`TensorParallelExecutor`), which shows the engine the same surface.

Both have `close()`; the engine calls it once when it stops (a lone runner holds no
processes, so for it this does nothing).
"""

from __future__ import annotations

from typing import Any

from carpool.distributed import RankFailedError
from carpool.runner.model_runner import ModelRunner

__all__ = ["RankFailedError", "create_executor"]


def create_executor(runner_kwargs: dict[str, Any], tensor_parallel_size: int = 1,
                    distributed_init_method: str | None = None):
    """A `ModelRunner(**runner_kwargs)` for one rank; else a `TensorParallelExecutor` that
    spawns ranks 1..N-1 here (no init method) or meets them through `distributed_init_method`."""
    if tensor_parallel_size == 1 and distributed_init_method is None:
        return ModelRunner(**runner_kwargs)
    from carpool.runner.tp_executor import TensorParallelExecutor
    return TensorParallelExecutor(runner_kwargs, tensor_parallel_size, distributed_init_method)
