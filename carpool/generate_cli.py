"""`carpool generate [MODEL] --prompt ...`: a quick look at a model's completions, offline.

Engine and scheduler flags are the same as `carpool serve`'s (vLLM's names);
the sampling flags map one to one onto `SamplingParams`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from carpool.arg_utils import (
    add_engine_arguments,
    add_log_level_argument,
    add_model_argument,
    add_scheduler_arguments,
    configure_logging,
)
from carpool.config import EngineConfig
from carpool.sampling_params import SamplingParams

logger = logging.getLogger("carpool.generate")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--prompt", action="append", required=True,
                        help="A prompt; repeat the flag for several (they run as one batch).")
    parser.add_argument("--chat", action="store_true",
                        help="Send each prompt as a user message through the chat template.")
    parser.add_argument("--no-tqdm", dest="use_tqdm", action="store_false",
                        help="Hide the progress bar.")
    add_log_level_argument(parser, default="warning")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=64, help="Tokens per completion.")
    sampling.add_argument("--temperature", type=float, default=1.0, help="0 means greedy.")
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0, help="0 disables.")
    sampling.add_argument("--min-p", type=float, default=0.0)
    sampling.add_argument("--n", type=int, default=1, help="Completions per prompt.")
    sampling.add_argument("--sampling-seed", type=int, default=None,
                          help="Per-request seed: same seed, same output.")
    sampling.add_argument("--stop", action="append", default=[], help="A stop string (repeatable).")
    sampling.add_argument("--ignore-eos", action="store_true", help="Keep going past EOS.")
    sampling.add_argument("--logprobs", type=int, default=None,
                          help="Show the top-N logprobs of each output token.")
    add_engine_arguments(parser.add_argument_group("engine"))
    add_scheduler_arguments(parser.add_argument_group("scheduler"))


def run(args: argparse.Namespace) -> int:
    from carpool.llm import LLM

    configure_logging(args.log_level)
    try:
        params = SamplingParams(
            n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, stop=tuple(args.stop),
            ignore_eos=args.ignore_eos, logprobs=args.logprobs)
        with LLM.from_config(EngineConfig.from_cli_args(args)) as llm:  # stops TP ranks
            if args.chat:
                conversations = [[{"role": "user", "content": p}] for p in args.prompt]
                outputs = llm.chat(conversations, params, use_tqdm=args.use_tqdm)
            else:
                outputs = llm.generate(args.prompt, params, use_tqdm=args.use_tqdm)
    except (ValueError, FileNotFoundError) as exc:
        print(f"carpool generate: error: {exc}", file=sys.stderr)
        return 2
    for i, (prompt, output) in enumerate(zip(args.prompt, outputs)):
        print(f"=== prompt {i}: {prompt!r}")
        for completion in output.outputs:
            label = f"[{completion.index}] " if len(output.outputs) > 1 else ""
            print(f"{label}{completion.text}")
            stop = f", stop_reason={completion.stop_reason!r}" if completion.stop_reason else ""
            print(f"--- {len(completion.token_ids)} tokens, "
                  f"finish_reason={completion.finish_reason}{stop}")
            if completion.logprobs:
                _print_logprobs(completion)
    return 0


def _print_logprobs(completion) -> None:
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        top = sorted(position.items(), key=lambda item: -item[1].logprob)
        alternatives = ", ".join(f"{lp.decoded_token!r}:{lp.logprob:.3f}" for _, lp in top)
        print(f"  {position[token_id].decoded_token!r} <- {alternatives}")
