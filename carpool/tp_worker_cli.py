"""`carpool tp-worker [MODEL]`: one tensor-parallel rank other than 0, started by its own command.

For a group spread over machines (one command per node): rank 0 runs
`carpool serve ... --tensor-parallel-size N --distributed-init-method env://`,
every other rank this command with the same model and engine flags, and each
sets MASTER_ADDR / MASTER_PORT (rank 0's address), RANK and WORLD_SIZE=N, which
torch's env:// rendezvous reads. The worker loads its shard, runs every step rank
0 broadcasts and exits 0 when rank 0 shuts down, 1 when rank 0 is lost.
"""

from __future__ import annotations

import argparse
import logging

from carpool.arg_utils import (
    add_engine_arguments,
    add_log_level_argument,
    add_model_argument,
    add_scheduler_arguments,
    configure_logging,
)
from carpool.config import EngineConfig

logger = logging.getLogger("carpool.tp_worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    add_log_level_argument(parser, default="info")
    add_engine_arguments(parser.add_argument_group("engine (the same as rank 0's)"))
    add_scheduler_arguments(parser.add_argument_group("scheduler (the same as rank 0's)"))
    parser.set_defaults(distributed_init_method="env://")


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        # Rank 0 is `carpool serve`, so its defaults are the server's.
        config = EngineConfig.from_cli_args(args, usage="server")
    except (ValueError, FileNotFoundError) as exc:
        logger.error("invalid settings: %s", exc)
        return 2
    from carpool.engine.runner_setup import run_tensor_parallel_worker
    run_tensor_parallel_worker(config)  # ends the process
