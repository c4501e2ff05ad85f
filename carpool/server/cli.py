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
import re

from carpool.config import DTYPES, EngineConfig
from carpool.core.config import PREEMPTION_POLICIES, SCHEDULER_KINDS, SchedulerConfig

logger = logging.getLogger("carpool.server")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '2e9', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (try 4GiB or 512MiB)")
    try:
        value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}") from None
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face model folder or hub id (default: the built-in model).")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="Address to bind (default 127.0.0.1; 0.0.0.0 exposes the server).")
    server.add_argument("--port", type=int, default=8000, help="Port to bind (default 8000).")
    server.add_argument("--api-key", default=os.environ.get("CARPOOL_API_KEY"),
                        help="Require 'Authorization: Bearer KEY' on every route but /health "
                             "(default: $CARPOOL_API_KEY).")
    server.add_argument("--served-model-name", default=None,
                        help="Model name clients send and responses report (default: MODEL).")
    server.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"), help="Logging level.")
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
    group.add_argument("--trust-remote-code", action="store_true",
                       help="Not supported: carpool never runs code shipped with a checkpoint.")


def add_engine_arguments(group) -> None:
    group.add_argument("--dtype", default="auto", choices=DTYPES,
                       help="Weights and activations dtype (auto: the checkpoint's).")
    group.add_argument("--device", default="auto",
                       help="Device: auto (cuda if available, else cpu), cpu, cuda, cuda:N.")
    group.add_argument("--seed", type=int, default=0, help="Seed of the sampler's generators.")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="Fraction of GPU memory the model and KV cache may use (CUDA only).")
    group.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES",
                       help="KV cache size in bytes, e.g. 2GiB (overrides the GPU fraction).")
    group.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", dest="num_kv_blocks",
                       type=int, default=None, help="Exact number of KV cache blocks (tests, tuning).")
    group.add_argument("--tensor-parallel-size", type=int, default=1, choices=(1,),
                       help="Devices to shard the model over (only 1 is supported).")


def add_scheduler_arguments(group) -> None:
    defaults = SchedulerConfig()
    group.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                       help=f"Most requests running at once (default {defaults.max_num_seqs}).")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="Most tokens per step, the step's budget "
                            f"(default {defaults.max_num_batched_tokens}).")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="Longest prompt + output (default: the model's, capped at 8192).")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=defaults.enable_chunked_prefill,
                       help="Split long prompts into chunks that share steps with decodes.")
    group.add_argument("--max-num-partial-prefills", type=int,
                       default=defaults.max_num_partial_prefills,
                       help="Most requests part-way through their prompt at once.")
    group.add_argument("--max-long-partial-prefills", type=int,
                       default=defaults.max_long_partial_prefills,
                       help="Of those, most with prompts longer than the threshold.")
    group.add_argument("--long-prefill-token-threshold", type=int, default=0,
                       help="A prompt longer than this is 'long'; chunks are capped at it (0: auto).")
    group.add_argument("--block-size", type=int, default=defaults.block_size,
                       help=f"Tokens per KV cache block (default {defaults.block_size}).")
    group.add_argument("--scheduler", default=defaults.scheduler, choices=SCHEDULER_KINDS,
                       help="continuous batching, or the static baseline.")
    group.add_argument("--preemption-policy", default=defaults.preemption_policy,
                       choices=PREEMPTION_POLICIES,
                       help="Which running request gives up its blocks when the cache is full.")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=defaults.enable_prefix_caching,
                       help="Reuse the KV cache of prompt prefixes earlier requests computed "
                            "(default on).")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe; ValueError names a bad flag's field."""
    defaults = SchedulerConfig()
    max_model_len = args.max_model_len or defaults.max_model_len
    budget = args.max_num_batched_tokens
    if budget is None:
        budget = defaults.max_num_batched_tokens
        if not args.enable_chunked_prefill:
            budget = max(budget, max_model_len)
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
        max_model_len=max_model_len, enable_chunked_prefill=args.enable_chunked_prefill,
        max_num_partial_prefills=args.max_num_partial_prefills,
        max_long_partial_prefills=args.max_long_partial_prefills,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        block_size=args.block_size, preemption_policy=args.preemption_policy,
        scheduler=args.scheduler, enable_prefix_caching=args.enable_prefix_caching)
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
        served_model_name=args.served_model_name, num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        scheduler=scheduler, max_model_len=args.max_model_len)


def server_settings_from_args(args: argparse.Namespace):
    """The ServerSettings the flags describe; ValueError names a bad flag's field."""
    from carpool.server.app import ServerSettings
    return ServerSettings(
        api_key=args.api_key, max_request_body_bytes=args.max_request_body_bytes,
        max_num_waiting_requests=args.max_num_waiting_requests,
        shutdown_timeout=args.shutdown_timeout, log_prompts=args.log_prompts)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.trust_remote_code:
        logger.error("--trust-remote-code is not supported: carpool runs only its own model "
                     "code (Llama, Mistral, Qwen2, Qwen3) and loads weights from safetensors, "
                     "never code or pickles from a checkpoint")
        return 2
    try:
        config = engine_config_from_args(args)
        settings = server_settings_from_args(args)
    except ValueError as exc:
        logger.error("invalid settings: %s", exc)
        return 2
    from carpool.server.serve import serve
    return serve(config, settings, host=args.host, port=args.port, log_level=args.log_level)
