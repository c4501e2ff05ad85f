"""Joining the ranks of a tensor-parallel group: torch.distributed's rendezvous, then the groups.

`init_method` is a torch.distributed URL. carpool's own one-machine launch uses
`tcp://127.0.0.1:PORT` on a port it found free (`local_init_method`), naming
each rank itself. `env://` is for ranks started by someone else (torchrun, or
one command per node): torch's rendezvous reads MASTER_ADDR, MASTER_PORT, RANK
and WORLD_SIZE, and this module only checks that the world it joined has the
size the config asks for.
"""

from __future__ import annotations

import datetime
import logging
import socket

import torch
import torch.distributed as dist

from carpool.distributed.group import TensorParallelGroup

logger = logging.getLogger(__name__)

# How long a rank waits for the others to join, and for any one collective.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def backend_for(device: torch.device) -> str:
    """The device group's backend: NCCL between CUDA devices, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def local_init_method() -> str:
    """A tcp:// rendezvous URL on a free loopback port (ranks on this machine only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def join_group(init_method: str, world_size: int, device: torch.device, *,
               rank: int | None = None,
               timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> TensorParallelGroup:
    """Rendezvous with the other ranks and build the device and CPU groups.

    `rank` None takes the rank the rendezvous assigns (env://: RANK). Raises ValueError
    when the world joined is not `world_size` ranks.
    """
    store, rank, joined_size = next(dist.rendezvous(
        init_method, rank=-1 if rank is None else rank,
        world_size=-1 if init_method.startswith("env://") else world_size, timeout=timeout))
    if joined_size != world_size:
        raise ValueError(f"tensor_parallel_size is {world_size} but the rendezvous at "
                         f"{init_method} has a world of {joined_size} ranks")
    store.set_timeout(timeout)
    backend = backend_for(device)
    cpu_group = _gloo(dist.PrefixStore("carpool/cpu", store), rank, world_size, timeout)
    if backend == "nccl":
        device_group = dist.ProcessGroupNCCL(dist.PrefixStore("carpool/device", store), rank,
                                             world_size)
    else:
        device_group = _gloo(dist.PrefixStore("carpool/device", store), rank, world_size, timeout)
    heartbeat_group = _gloo(dist.PrefixStore("carpool/heartbeat", store), rank, world_size,
                            timeout)
    group = TensorParallelGroup(rank, world_size, device_group=device_group,
                                cpu_group=cpu_group, heartbeat_group=heartbeat_group,
                                backend=backend, store=store)
    logger.info("joined %s via %s", group.describe(), init_method)
    return group


def _gloo(store, rank: int, world_size: int, timeout: datetime.timedelta):
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)
