"""What building an engine's runner takes from its config, on rank 0 (`LLMEngine.from_config`)
and on a tensor-parallel worker rank started by its own command (`carpool tp-worker`):
the config resolved against the model and its device, which every rank's `ModelRunner` is
built from, and a data-parallel replica's share of the machine."""

from __future__ import annotations

import logging
from typing import NoReturn

from carpool.config import EngineConfig
from carpool.config.named_files import model_or_default


def resolve_for_model(config: EngineConfig):
    """(config resolved against its model's limits and its device, the model's folder)."""
    from carpool.models.config import load_model_config
    from carpool.models.paths import resolve_model_path
    from carpool.utils.device import resolve_device

    path = resolve_model_path(model_or_default(config.model))
    config = config.for_device(resolve_device(config.device).type)
    return config.for_model(load_model_config(path).max_position_embeddings), path


def place_replica(config: EngineConfig) -> EngineConfig:
    """A data-parallel replica's share of the machine, set in its own engine process before
    the model loads: 1/N of this process's torch threads (its tensor-parallel ranks inherit
    the count), and on CUDA cards r*T .. r*T+T-1 for replica r of T ranks (its ranks count
    from its first card, `device_for_rank`). Changes torch's thread count; returns the
    config with the replica's first card. A config of one replica is returned as is."""
    size, rank = config.data_parallel_size, config.data_parallel_rank
    if size == 1:
        return config
    import dataclasses

    import torch
    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    if config.device not in ("auto", "cuda") or not torch.cuda.is_available():
        return config  # CPU (or a card the user named for every replica)
    num_ranks = config.tensor_parallel_size
    num_cards = torch.cuda.device_count()
    if size * num_ranks > num_cards:
        logging.getLogger(__name__).warning(
            "%d data-parallel replica(s) x %d tensor-parallel rank(s) on %d CUDA card(s): "
            "processes share cards, so lower --gpu-memory-utilization to leave room for each",
            size, num_ranks, num_cards)
    return dataclasses.replace(config, device=f"cuda:{(rank * num_ranks) % num_cards}")


def run_tensor_parallel_worker(config: EngineConfig) -> NoReturn:
    """Serve as a rank other than 0 of the group `config.distributed_init_method` names;
    the process exits 0 when rank 0 shuts the group down, 1 when it is lost. The rank comes
    from the rendezvous (RANK)."""
    from carpool.runner.tp_worker import join_and_run

    if config.distributed_init_method is None:
        raise ValueError("a tensor-parallel worker needs distributed_init_method (env://)")
    config, path = resolve_for_model(config)
    join_and_run(config, path)
