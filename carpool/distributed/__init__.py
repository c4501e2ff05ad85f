"""Tensor parallelism's plumbing over torch.distributed: the group of ranks and its
collectives (`group`), joining it (`rendezvous`), and noticing a lost rank (`heartbeat`).
Torch only; the model and runner receive a `TensorParallelGroup` and never build one."""

from carpool.distributed.group import SINGLE, TensorParallelGroup
from carpool.distributed.heartbeat import Heartbeat, RankFailedError
from carpool.distributed.rendezvous import backend_for, join_group, local_init_method

__all__ = ["SINGLE", "Heartbeat", "RankFailedError", "TensorParallelGroup", "backend_for",
           "join_group", "local_init_method"]
