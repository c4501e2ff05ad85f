"""The collectives of a real two-rank gloo group (two threads of this process), and which
backend and device each rank gets."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from carpool.distributed import (
    SINGLE,
    Heartbeat,
    backend_for,
    join_group,
    local_init_method,
)
from carpool.utils.device import device_for_rank


def on_two_ranks(fn):
    """[fn(group of rank 0), fn(group of rank 1)], the ranks joined over loopback."""
    url = local_init_method()
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(
            lambda rank: fn(join_group(url, 2, torch.device("cpu"), rank=rank)), (0, 1)))


def test_collectives_across_two_ranks():
    message = torch.arange(7, dtype=torch.int64)

    def run(group):
        x = torch.full((2, 3), float(group.rank + 1))
        return (group.broadcast_ints(message if group.rank == 0 else None),
                group.all_reduce(x.clone()), group.all_gather(x),
                group.all_reduce_min(10 + group.rank), group.backend)

    (obj0, sum0, gathered0, min0, backend), (obj1, sum1, gathered1, min1, _) = on_two_ranks(run)
    assert torch.equal(obj0, message) and torch.equal(obj1, message)
    assert torch.equal(sum0, torch.full((2, 3), 3.0)) and torch.equal(sum0, sum1)
    assert torch.equal(gathered1, torch.cat([torch.ones(2, 3), torch.full((2, 3), 2.0)], -1))
    assert min0 == min1 == 10
    assert backend == "gloo"


def test_the_one_rank_group_is_the_identity():
    x = torch.randn(2, 3)
    assert SINGLE.all_reduce(x) is x and SINGLE.all_gather(x) is x
    assert SINGLE.broadcast_ints(x) is x and SINGLE.all_reduce_min(7) == 7


def test_a_heartbeat_notices_a_rank_that_leaves():
    failures = []
    failed = threading.Event()

    def run(group):
        if group.rank == 1:  # leaves without a word: its sockets close
            group.device_group = group.cpu_group = group.heartbeat_group = None
            return None
        beat = Heartbeat(group, lambda exc: (failures.append(exc), failed.set()), interval=0.1)
        beat.start()
        return beat

    beat, _ = on_two_ranks(run)
    import gc
    gc.collect()  # drops rank 1's process groups
    assert failed.wait(15), "rank 0's heartbeat never failed"
    beat.stop()
    assert "another rank stopped answering" in str(failures[0])


def test_backend_and_device_per_rank(monkeypatch):
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda")) == "nccl"
    assert device_for_rank(torch.device("cpu"), 1) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # the one torch.cuda call
    assert device_for_rank(torch.device("cuda"), 1) == torch.device("cuda", 1)
    assert device_for_rank(torch.device("cuda"), 3) == torch.device("cuda", 1)
    assert device_for_rank(torch.device("cuda", 0), 1) == torch.device("cuda", 1)
    assert device_for_rank(torch.device("cuda", 1), 1) == torch.device("cuda", 0)  # from card 1


def test_a_world_of_the_wrong_size_is_refused(monkeypatch):
    url = local_init_method()
    port = url.rpartition(":")[2]
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0",
                            WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"tensor_parallel_size is 2 but the rendezvous at "
                                         r"env:// has a world of 1 ranks"):
        join_group("env://", 2, torch.device("cpu"))
