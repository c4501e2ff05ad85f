"""`carpool serve [MODEL]`: the OpenAI-compatible server, with vLLM's flag names.

The port is bound at once and /health answers 503 while the engine thread
loads the model; the start-up log then states the KV cache in blocks, tokens
and bytes, and the concurrency it allows. If the engine loop dies the server
stops and the command exits non-zero.
"""

from __future__ import annotations

import argparse
import logging
import os

from carpool.arg_utils import (
    add_engine_arguments,
    add_log_level_argument,
    add_model_argument,
    add_scheduler_arguments,
    configure_logging,
    parse_bytes,
)
from carpool.config import EngineConfig

logger = logging.getLogger("carpool.server")

def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="Address to bind (default 127.0.0.1; 0.0.0.0 exposes the server).")
    server.add_argument("--port", type=int, default=8000, help="Port to bind (default 8000).")
    server.add_argument("--api-key", default=os.environ.get("CARPOOL_API_KEY"),
                        help="Require 'Authorization: Bearer KEY' on every route but /health "
                             "(default: $CARPOOL_API_KEY).")
    server.add_argument("--served-model-name", default=None,
                        help="Model name clients send and responses report (default: MODEL).")
    add_log_level_argument(server, default="info")
    _add_robustness_arguments(server)
    add_engine_arguments(parser.add_argument_group("engine"))
    add_scheduler_arguments(parser.add_argument_group("scheduler"))


def _add_robustness_arguments(group) -> None:
    from carpool.server.app import DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_SHUTDOWN_TIMEOUT_S
    group.add_argument("--max-request-body-bytes", type=parse_bytes,
                       default=DEFAULT_MAX_REQUEST_BODY_BYTES, metavar="BYTES",
                       help="Larger request bodies get a 413 before they are parsed "
                            f"(default {DEFAULT_MAX_REQUEST_BODY_BYTES // 2**20}MiB).")
    group.add_argument("--max-num-waiting-requests", type=int, default=None,
                       help="Most requests queued for the engine; beyond it new requests get "
                            "503 with Retry-After (default: 4 x --max-num-seqs).")
    group.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                       metavar="SECONDS",
                       help="On SIGTERM, how long in-flight requests may take to finish before "
                            "they are aborted with an error "
                            f"(default {DEFAULT_SHUTDOWN_TIMEOUT_S:g}).")
    group.add_argument("--log-prompts", action="store_true",
                       help="Include prompts in the per-request log lines (off: never logged).")
    group.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                       help="Run the engine (scheduler, model, KV cache) in its own process, "
                            "apart from HTTP, tokenization and metrics (default); "
                            "--no-engine-process runs it on a thread of the server's process.")


def server_settings_from_args(args: argparse.Namespace):
    """The ServerSettings the flags describe; ValueError names a bad flag's field."""
    from carpool.server.app import ServerSettings
    return ServerSettings(
        api_key=args.api_key, max_request_body_bytes=args.max_request_body_bytes,
        max_num_waiting_requests=args.max_num_waiting_requests,
        shutdown_timeout=args.shutdown_timeout, log_prompts=args.log_prompts,
        engine_process=args.engine_process)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        config = EngineConfig.from_cli_args(args)
        settings = server_settings_from_args(args)
    except (ValueError, FileNotFoundError) as exc:
        logger.error("invalid settings: %s", exc)
        return 2
    from carpool.server.serve import serve
    return serve(config, settings, host=args.host, port=args.port, log_level=args.log_level)
