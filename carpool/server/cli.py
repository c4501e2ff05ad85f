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
from carpool.server.lora_adapters import check_lora_modules, parse_lora_modules

logger = logging.getLogger("carpool.server")

def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="Address to bind (default 127.0.0.1; 0.0.0.0 exposes the server).")
    server.add_argument("--port", type=int, default=8000, help="Port to bind (default 8000).")
    server.add_argument("--api-key", default=os.environ.get("CARPOOL_API_KEY"),
                        help="Require 'Authorization: Bearer KEY' on the /v1 routes, /tokenize, "
                             "/detokenize, /stats, /reset_prefix_cache and the API docs; "
                             "/metrics and the probes stay open (default: $CARPOOL_API_KEY).")
    server.add_argument("--served-model-name", default=None,
                        help="Model name clients send and responses report (default: MODEL).")
    add_log_level_argument(server, default="info")
    server.add_argument("--uvicorn-log-level", default=None,
                        choices=("debug", "info", "warning", "error", "critical", "trace"),
                        help="uvicorn's own log level (access lines at info) (default: "
                             "--log-level).")
    server.add_argument("--disable-log-stats", action="store_true",
                        help="No periodic throughput / KV cache log line (the /metrics "
                             "numbers are kept).")
    server.add_argument("--enable-log-requests", action="store_true",
                        help="One log line per request (id, size, sampling; the prompt only "
                             "with --log-prompts). Off by default, as in vLLM.")
    _add_robustness_arguments(server)
    server.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="Engine replicas behind this server, each its own process with its "
                             "own KV cache (and its own CUDA card, or 1/N of the CPU threads); "
                             "requests go to the least loaded (default 1).")
    _add_lora_server_arguments(server)
    add_engine_arguments(parser.add_argument_group("engine"))
    add_scheduler_arguments(parser.add_argument_group("scheduler"))


def _add_robustness_arguments(group) -> None:
    from carpool.server.app import (
        DEFAULT_ENGINE_STALL_TIMEOUT_S,
        DEFAULT_MAX_REQUEST_BODY_BYTES,
        DEFAULT_MAX_STREAM_BACKLOG,
        DEFAULT_SHUTDOWN_TIMEOUT_S,
        DEFAULT_STREAM_PAUSE_BACKLOG,
        DEFAULT_TIMEOUT_KEEP_ALIVE_S,
    )
    from carpool.server.http_protocol import (
        DEFAULT_MAX_CONNECTIONS,
        DEFAULT_READ_TIMEOUT_S,
        DEFAULT_SEND_BUFFER_BYTES,
        DEFAULT_WRITE_TIMEOUT_S,
    )
    from carpool.server.logprobs import DEFAULT_MAX_LOGPROB_WORK
    from carpool.server.prompts import DEFAULT_MAX_TOKENIZER_QUEUE
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
    group.add_argument("--http-read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S,
                       metavar="SECONDS",
                       help="A connection must send a whole request (headers and body) within "
                            "this long of connecting or of its previous response, else it is "
                            f"closed (default {DEFAULT_READ_TIMEOUT_S:g}).")
    group.add_argument("--http-write-timeout", type=float, default=DEFAULT_WRITE_TIMEOUT_S,
                       metavar="SECONDS",
                       help="A client that stops reading its response for this long (its "
                            "socket's buffers full) is disconnected and its requests aborted "
                            f"(default {DEFAULT_WRITE_TIMEOUT_S:g}).")
    group.add_argument("--max-stream-backlog", type=int, default=DEFAULT_MAX_STREAM_BACKLOG,
                       metavar="OUTPUTS",
                       help="A streamed response whose reader leaves more outputs than this "
                            "unread is ended and its requests aborted "
                            f"(default {DEFAULT_MAX_STREAM_BACKLOG}).")
    group.add_argument("--stream-pause-backlog", type=int, default=DEFAULT_STREAM_PAUSE_BACKLOG,
                       metavar="OUTPUTS",
                       help="Flow control: a streamed response whose reader leaves this many "
                            "outputs unread (at least one step's worth) has its requests paused "
                            "- not scheduled, their seats given to others - until it catches "
                            f"up; 0 never pauses (default {DEFAULT_STREAM_PAUSE_BACKLOG}).")
    group.add_argument("--http-send-buffer", type=int, default=DEFAULT_SEND_BUFFER_BYTES,
                       metavar="BYTES",
                       help="Send buffer (SO_SNDBUF) of each client socket, so that a client "
                            "that stops reading is noticed after this much output rather than "
                            "the megabytes the kernel would buffer; 0 leaves the kernel's "
                            f"(default {DEFAULT_SEND_BUFFER_BYTES}).")
    group.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                       help="Most open client connections (lowered to fit the open-files "
                            "limit); a new one over it evicts the oldest connection that has "
                            f"not yet sent a whole request (default {DEFAULT_MAX_CONNECTIONS}).")
    group.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
                       metavar="SECONDS",
                       help="Close an idle keep-alive connection after this long "
                            f"(default {DEFAULT_TIMEOUT_KEEP_ALIVE_S:g}, as uvicorn).")
    group.add_argument("--max-tokenizer-queue", type=int, default=DEFAULT_MAX_TOKENIZER_QUEUE,
                       metavar="JOBS",
                       help="Most tokenizer jobs queued per lane (generation prompts; /tokenize "
                            "and /detokenize); beyond it a 503 with Retry-After "
                            f"(default {DEFAULT_MAX_TOKENIZER_QUEUE}).")
    group.add_argument("--max-logprob-work", type=int, default=DEFAULT_MAX_LOGPROB_WORK,
                       metavar="ENTRIES",
                       help="Most logprob entries one request may ask for: prompt tokens x "
                            "(prompt_logprobs + 1) + max_tokens x (logprobs + 1), over its "
                            "prompts and choices; beyond it a 400 "
                            f"(default {DEFAULT_MAX_LOGPROB_WORK}).")
    group.add_argument("--engine-stall-timeout", type=float,
                       default=DEFAULT_ENGINE_STALL_TIMEOUT_S, metavar="SECONDS",
                       help="An engine that has work but has finished no step for this long is "
                            "reported stalled: /health and /ping 503, /load says so, until steps "
                            f"resume; 0 never (default {DEFAULT_ENGINE_STALL_TIMEOUT_S:g}).")
    group.add_argument("--log-prompts", action="store_true",
                       help="Log each request with its prompt (implies --enable-log-requests; "
                            "off: prompts are never logged).")
    group.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                       help="Run the engine (scheduler, model, KV cache) in its own process, "
                            "apart from HTTP, tokenization and metrics (default); "
                            "--no-engine-process runs it on a thread of the server's process.")
    _add_tool_arguments(group)


def _add_tool_arguments(group) -> None:
    from carpool.server.tool_parsers import PARSER_NAMES
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='Allow tool_choice "auto": the model\'s own tool calls are read '
                            "back with --tool-call-parser.")
    group.add_argument("--tool-call-parser", choices=PARSER_NAMES, default=None,
                       help="How the model writes tool calls: hermes (<tool_call>{...}"
                            "</tool_call>) or llama3_json.")


def _add_lora_server_arguments(group) -> None:
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH|JSON",
                       help="LoRA adapters (PEFT folders) served by name, as name=path or "
                            "JSON {\"name\": ..., \"path\": ..., \"base_model_name\": ...}; "
                            "needs --enable-lora.")
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                            "(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).")


def server_settings_from_args(args: argparse.Namespace):
    """The ServerSettings the flags describe; ValueError names a bad flag's field."""
    from carpool.server.app import ServerSettings
    return ServerSettings(
        api_key=args.api_key, max_request_body_bytes=args.max_request_body_bytes,
        max_num_waiting_requests=args.max_num_waiting_requests,
        shutdown_timeout=args.shutdown_timeout, log_prompts=args.log_prompts,
        http_read_timeout=args.http_read_timeout, http_write_timeout=args.http_write_timeout,
        max_stream_backlog=args.max_stream_backlog,
        stream_pause_backlog=args.stream_pause_backlog, http_send_buffer=args.http_send_buffer,
        max_connections=args.max_connections,
        timeout_keep_alive=args.timeout_keep_alive,
        log_requests=args.enable_log_requests or args.log_prompts,
        log_stats=not args.disable_log_stats,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        engine_process=args.engine_process, data_parallel_size=args.data_parallel_size,
        max_tokenizer_queue=args.max_tokenizer_queue, max_logprob_work=args.max_logprob_work,
        engine_stall_timeout=args.engine_stall_timeout,
        lora_modules=parse_lora_modules(args.lora_modules),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        config = EngineConfig.from_cli_args(args, usage="server")
        settings = server_settings_from_args(args)
        check_lora_modules(config, settings.lora_modules)
    except (ValueError, OSError) as exc:
        # One line, no traceback, before anything binds the port (exit 1, as vLLM's).
        logger.error("invalid settings: %s", " ".join(str(exc).split()))
        return 1
    from carpool.server.serve import serve
    return serve(config, settings, host=args.host, port=args.port,
                 log_level=args.uvicorn_log_level or args.log_level)
