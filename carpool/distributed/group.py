"""The collectives tensor parallelism needs, over one group of ranks.

A `TensorParallelGroup` wraps two torch.distributed process groups over the
same ranks: `device_group` for the activations (NCCL on CUDA, gloo on CPU:
the all-reduce after every row-parallel linear, the all-gather of vocabulary
shards of the logits) and `cpu_group`, always gloo, for the per-step
`SchedulerOutput` that rank 0 broadcasts as int64s (`runner.step_message`; NCCL
moves only device tensors). The groups are built straight over a store rather than through
`init_process_group`, so no process-wide default group exists and several
engines (tests) can live in one process.

A third gloo group carries nothing but the heartbeat (`carpool.distributed.heartbeat`).

`SINGLE` is the group of one rank: every collective is the identity, so the
model code has no "is it parallel?" branch and TP=1 runs exactly as before.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class TensorParallelGroup:
    def __init__(self, rank: int, world_size: int, *, device_group=None, cpu_group=None,
                 heartbeat_group=None, backend: str = "none", store=None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        self.rank, self.world_size = rank, world_size
        self.device_group, self.cpu_group = device_group, cpu_group
        # Its own gloo group, so `Heartbeat`'s thread never interleaves with a step's collectives.
        self.heartbeat_group = heartbeat_group
        self.backend = backend
        self.store = store  # kept alive: rank 0's store object runs the rendezvous server

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        return f"tensor parallel rank {self.rank} of {self.world_size} ({self.backend})"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        if self.is_parallel:
            self.device_group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, d] on each rank -> [N, world_size * d], rank r's columns at [r*d, (r+1)*d)."""
        if not self.is_parallel:
            return x
        pieces = [torch.empty_like(x) for _ in range(self.world_size)]
        self.device_group.allgather([pieces], [x.contiguous()]).wait()
        return torch.cat(pieces, dim=-1)

    def all_reduce_min(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the KV blocks each rank can hold)."""
        if not self.is_parallel:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.cpu_group.allreduce([t], options).wait()
        return int(t.item())

    def broadcast_ints(self, values: torch.Tensor | None = None) -> torch.Tensor:
        """Rank 0's 1-D int64 tensor on every rank (the others pass nothing): its length
        first, then the values; two gloo broadcasts."""
        if not self.is_parallel:
            return values
        if self.rank == 0:
            length = torch.tensor([values.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        self._broadcast(length)
        if self.rank != 0:
            values = torch.empty(int(length.item()), dtype=torch.int64)
        self._broadcast(values)
        return values

    def _broadcast(self, t: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.cpu_group.broadcast([t], options).wait()


SINGLE = TensorParallelGroup(0, 1)
