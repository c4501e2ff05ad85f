"""`carpool bench serve|offline`: the load generator and the in-process comparisons.

    carpool bench serve --base-url http://127.0.0.1:8000 --workload random --request-rate 4
    carpool bench offline --model CKPT --workload mix --compare static,continuous,chunked \
        --plot slots.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys

from carpool.bench.offline import DEFAULT_COMPARE, VARIANTS
from carpool.bench.serve_client import BACKENDS
from carpool.bench.workloads import WORKLOADS, WorkloadConfig
from carpool.config import DTYPE_ALIASES, DTYPES

# `vllm bench serve`'s defaults, so a run without flags sends the same load.
SERVE_WORKLOAD = WorkloadConfig(name="random", num_prompts=1000, input_len=1024, output_len=128,
                                range_ratio=0.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    serve = sub.add_parser("serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                           help="Streaming load generator for an OpenAI-compatible server "
                                "(vllm bench serve's defaults).")
    _add_workload_arguments(serve, SERVE_WORKLOAD)
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="Server to load.")
    serve.add_argument("--backend", choices=tuple(BACKENDS), default="openai",
                       help="openai: streamed /v1/completions; openai-chat: streamed "
                            "/v1/chat/completions, the prompt as one user message.")
    serve.add_argument("--endpoint", default=None,
                       help="Path to post to; None: the backend's.")
    serve.add_argument("--model",
                       help="Model name to ask for; None: the first /v1/models lists.")
    serve.add_argument("--tokenizer", help="Tokenizer folder for building prompts; None: "
                       "the built-in model's.")
    serve.add_argument("--request-rate", type=float, default=math.inf,
                       help="Requests per second, Poisson arrivals; inf sends all at once.")
    serve.add_argument("--max-concurrency", type=int, default=None,
                       help="At most this many requests in flight; None: no limit.")
    serve.add_argument("--temperature", type=float, default=None,
                       help="Sampling temperature sent with every request; None: none "
                            "sent, the server's default (0 is greedy).")
    serve.add_argument("--ignore-eos", action="store_true",
                       help="Ask for exactly max_tokens (vLLM's ignore_eos extension).")
    serve.add_argument("--slo", default=None,
                       help="Goodput SLOs in ms, e.g. ttft=500,tpot=50 (keys: ttft, tpot, e2el).")
    serve.add_argument("--api-key", default=None, help="Bearer token sent with every request.")
    serve.add_argument("--no-progress", action="store_true", help="Hide the progress bar.")
    serve.add_argument("--result-file", default=None, help="Write the figures as JSON here.")

    offline = sub.add_parser("offline", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                             help="In-process benchmark through the engine.")
    _add_workload_arguments(offline, WorkloadConfig())
    offline.add_argument("--model", help="Checkpoint folder; None: the built-in model.")
    offline.add_argument("--scheduler", choices=("continuous", "static"), default="continuous")
    offline.add_argument("--no-chunked-prefill", action="store_true")
    offline.add_argument("--compare", nargs="?", const=",".join(DEFAULT_COMPARE),
                         help="Comma-separated variants run one after another on the same "
                              "requests (static, continuous, chunked, chunked-partial, "
                              "chunked-no-prefix-cache, chunked-ngram; default: the first three).")
    offline.add_argument("--repeat", type=int, default=1,
                         help="Rounds, for min/median/max of each ratio; every other round runs "
                              "the variants in reverse order.")
    offline.add_argument("--plot",
                         help="PNG: slot timeline and tokens per step, one column per variant.")
    offline.add_argument("--result-file", help="Write the figures as JSON here.")
    offline.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                         help="Time figures by wall clock, or by this process's CPU time (idle "
                              "waits "
                         "skipped): steadier on a machine shared with other jobs; use with "
                         "OMP_NUM_THREADS=1.")
    offline.add_argument("--no-progress", action="store_true")
    offline.add_argument("--dtype", choices=DTYPES + tuple(DTYPE_ALIASES), default=None,
                         help="The engine's dtype (default: the engine's, auto).")
    offline.add_argument("--draft-model", default=None,
                         help="The draft model's folder for the chunked-draft variant.")
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--num-kv-blocks",
                 "--max-num-partial-prefills", "--max-long-partial-prefills",
                 "--long-prefill-token-threshold"):
        offline.add_argument(flag, type=int)


_WORKLOAD_HELP = {
    "num_prompts": "Requests (mixed-load: the decoding ones)",
    "input_len": "Prompt tokens (random, mix, mixed-load decoders)",
    "output_len": "Output tokens (random)",
    "short_output_len":
        "Output tokens of the short half (mix) and of the long prompts (mixed-load)",
    "long_output_len": "Output tokens of the long half (mix) and of the decoders (mixed-load)",
    "num_long_prompts": "Long prompts arriving among the decoders (mixed-load)",
    "long_prompt_len": "Tokens of each long prompt (mixed-load)",
    "num_prefixes": "Distinct shared prefixes (prefix-repetition)",
    "prefix_len": "Tokens of each shared prefix (prefix-repetition)",
}


def _add_workload_arguments(parser: argparse.ArgumentParser, defaults: WorkloadConfig) -> None:
    """The workload flags, with `defaults`; vLLM's names (--dataset-name, --random-input-len,
    --random-output-len, --random-range-ratio) are aliases."""
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", "--dataset-name", dest="workload", choices=WORKLOADS,
                       default=defaults.name, help="Which requests to send.")
    group.add_argument("--dataset-path", help="ShareGPT-style JSON / JSONL (sharegpt workload).")
    group.add_argument("--seed", type=int, default=defaults.seed,
                       help="Seed of the workload and of Poisson arrivals.")
    for name, help_text in _WORKLOAD_HELP.items():
        flags = ["--" + name.replace("_", "-")]
        if name in ("input_len", "output_len"):
            flags.append("--random-" + name.replace("_", "-"))
        group.add_argument(*flags, dest=name, type=int, default=getattr(defaults, name),
                           help=help_text + ".")
    group.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float,
                       default=defaults.range_ratio,
                       help="Lengths are drawn from [len * (1 - r), len * (1 + r)].")
    group.add_argument("--long-prompt-interval", type=float, default=defaults.long_prompt_interval,
                       help="Seconds between long-prompt arrivals (mixed-load).")


def _workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        name=args.workload, num_prompts=args.num_prompts, seed=args.seed, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio,
        short_output_len=args.short_output_len, long_output_len=args.long_output_len,
        dataset_path=args.dataset_path, num_long_prompts=args.num_long_prompts,
        long_prompt_len=args.long_prompt_len, long_prompt_interval=args.long_prompt_interval,
        max_model_len=getattr(args, "max_model_len", None), num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len)


def _tokenizer(path: str | None):
    from carpool.default_model_path import default_model_path
    from carpool.engine.tokenizer import load_tokenizer

    return load_tokenizer(path or default_model_path())


def run(args: argparse.Namespace) -> int:
    try:
        if args.bench_command == "serve":
            return _run_serve(args)
        return _run_offline(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"carpool bench {args.bench_command}: error: {exc}", file=sys.stderr)
        return 2


def _run_serve(args: argparse.Namespace) -> int:
    from carpool.bench.serve_client import ServeConfig, run_load
    from carpool.bench.stats import format_summary, parse_slo, summarize
    from carpool.bench.workloads import build_workload

    slos = parse_slo(args.slo) if args.slo else None
    config = ServeConfig(base_url=args.base_url.rstrip("/"), model=args.model,
                         request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                         seed=args.seed, ignore_eos=args.ignore_eos, api_key=args.api_key,
                         temperature=args.temperature, backend=args.backend,
                         endpoint=args.endpoint)
    requests = build_workload(_workload_config(args), _tokenizer(args.tokenizer), with_text=True)
    results, duration = asyncio.run(run_load(requests, config, show_progress=not args.no_progress))
    summary = summarize(results, duration, slos)
    print(format_summary(summary))
    for failed in [r for r in results if not r.success][:3]:
        print(f"failed request: {failed.error}", file=sys.stderr)
    if args.result_file:
        _write_json(args.result_file, {"workload": vars(_workload_config(args)),
                                       "request_rate": None if math.isinf(args.request_rate)
                                       else args.request_rate,  # None: all at once
                                       "max_concurrency": args.max_concurrency,
                                       "slo": slos, **summary.to_dict()})
    return 0 if summary.num_completed else 1


def _run_offline(args: argparse.Namespace) -> int:
    from carpool.bench.compare import comparison_json, format_comparison
    from carpool.bench.offline import run_variant
    from carpool.bench.stats import format_summary, summarize
    from carpool.bench.workloads import build_workload

    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    variants = _variants(args)
    requests = build_workload(_workload_config(args), _tokenizer(args.model))
    max_model_len = args.max_model_len or max(len(r.prompt_token_ids) + r.max_tokens
                                              for r in requests)
    common = _engine_settings(args)
    rounds, runs = [], {}
    for round_index in range(args.repeat):
        summaries = {}
        # Every other round runs the variants in reverse order, so a machine that speeds up
        # or slows down over the run favours none of them.
        for variant in variants if round_index % 2 == 0 else variants[::-1]:
            runs[variant] = run_variant(args.model, requests, variant, common, max_model_len,
                                        args.clock, show_progress=not args.no_progress)
            summaries[variant] = summarize(runs[variant].results, runs[variant].duration_s)
            print(format_summary(summaries[variant],
                                 f"Offline {variant}, {args.clock} clock, round "
                                 f"{round_index + 1}/{args.repeat}", len(runs[variant].steps)),
                  flush=True)
        rounds.append({variant: summaries[variant] for variant in variants})
    baseline = "static" if "static" in variants else variants[0]
    if len(variants) > 1 or args.repeat > 1:
        print(format_comparison(rounds, baseline))
    if args.plot:
        from carpool.bench.plots import save_comparison_plot

        save_comparison_plot(args.plot, [runs[v] for v in variants])
        print(f"plot written to {args.plot}")
    if args.result_file:
        _write_json(args.result_file, {"workload": vars(_workload_config(args)), "engine": common,
                                       "max_model_len": max_model_len, "clock": args.clock,
                                       **comparison_json(rounds, baseline)})
    return 0


def _variants(args: argparse.Namespace) -> list[str]:
    if args.compare:
        names = [v.strip() for v in args.compare.split(",") if v.strip()]
        unknown = [v for v in names if v not in VARIANTS]
        if unknown or not names:
            raise ValueError(f"--compare: variants must be among {tuple(VARIANTS)}, got "
                             f"{args.compare!r}")
        return names
    if args.scheduler == "static":
        return ["static"]
    return ["continuous" if args.no_chunked_prefill else "chunked"]


def _engine_settings(args: argparse.Namespace) -> dict:
    names = ("dtype", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
             "max_num_partial_prefills", "max_long_partial_prefills",
             "long_prefill_token_threshold", "draft_model")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    print(f"results written to {path}")
