"""Time of the prefill and of a decode step, for A/B runs across commits, settings and devices.

Adds N requests (random prompts of 16-512 tokens, 32 output tokens each, greedy,
ignore_eos) to one engine, steps until every request has its first token (the
prefill phase), then runs the decodes to the end. Prints the time of the prefill
phase and the median time of a decode step. `--clock cpu` (the default) takes the
process's CPU time: on a shared machine it moves far less with other load than the
wall clock does; use one thread (`--threads 1`, the default) and
OMP_WAIT_POLICY=PASSIVE, and alternate the sides. `--clock wall` is for a GPU (each
`LLMEngine.step()` returns Python ints, so a CUDA step is synchronised). `--loop`
times a step as the server's engine ran it: on the HTTP process's engine thread
before issue 22 (`thread`) or in the engine-core process (`core`).

To compare commits, check the older one out in a worktree and import its carpool with
`--tree` (put first on sys.path: the one sys.path edit left in benchmarks/; the script
only passes engine arguments that are given, so older commits that lack a newer argument
still run):

    git worktree add /tmp/base <commit>
    OMP_WAIT_POLICY=PASSIVE python3 -m benchmarks.profile.step_times /tmp/vs-vllm/135m-bfloat16 \\
        --dtype bfloat16 --requests 40 --tree /tmp/base
    OMP_WAIT_POLICY=PASSIVE python3 -m benchmarks.profile.step_times /tmp/vs-vllm/135m-bfloat16 \\
        --dtype bfloat16 --requests 40 --engine-arg cpu_kernels=False
    python3 -m benchmarks.profile.step_times /tmp/vs-vllm/135m-bfloat16 --dtype bfloat16 \\
        --clock wall \\
        --requests 256 --engine-arg device=cuda --engine-arg attention_backend=sdpa
"""

from __future__ import annotations

import argparse
import ast
import random
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="checkpoint folder (make_vs_vllm_checkpoints.py)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--tree", default=None,
                        help="another carpool checkout to import (default: this one)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="an LLM(...) argument, e.g. cpu_kernels=False or device=cuda "
                             "(a Python literal, else a string; repeatable)")
    parser.add_argument("--loop", choices=("plain", "thread", "core"), default="plain",
                        help="what a step is: LLMEngine.step (plain); what the server's engine "
                             "thread ran per step before issue 22 (thread: step, stats, "
                             "Prometheus metrics); what the engine-core process runs (core: "
                             "step without detokenization, stats, the StepBatch pickled)")
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    if args.tree:
        sys.path.insert(0, args.tree)

    import torch

    from carpool import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    engine_args = dict(dtype=args.dtype, max_num_seqs=256, max_num_batched_tokens=2048,
                       kv_cache_memory=2 << 30, device="cpu")
    for item in args.engine_arg:
        name, _, value = item.partition("=")
        engine_args[name] = _literal(value)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    llm = LLM(args.model, **engine_args)
    engine = llm.engine
    step = {"plain": lambda e: e.step, "thread": _engine_thread_step,
            "core": _engine_core_step}[args.loop](engine)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len,
                            ignore_eos=True, temperature=0.0)
    begin = clock()
    for i in range(args.requests):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(16, 512))]
        engine.add_request(f"r{i}", prompt, params)
    started: set[str] = set()
    while len(started) < args.requests:
        started.update(out.request_id for out in step() if out.new_token_ids)
    prefill = clock() - begin
    steps = []
    while engine.has_unfinished_requests():
        begin = clock()
        step()
        steps.append(clock() - begin)
    print(f"{args.label or Path(args.tree).name} loop={args.loop} {Path(args.model).name} "
          f"{args.requests} requests: prefill {args.clock} {prefill:.2f} s, decode step "
          f"{args.clock} p50 "
          f"{1000 * statistics.median(steps):.1f} ms")
    return 0


def _engine_thread_step(engine):
    """A step as `AsyncEngine`'s loop thread runs it: the step (detokenizing), the stats
    snapshot, and the Prometheus metrics recorded on that thread."""
    from carpool.metrics import ServerMetrics

    metrics = ServerMetrics("bench")

    def step():
        outputs = engine.step()
        stats = engine.stats()
        metrics.update_gauges(stats)
        metrics.record_step(outputs, stats, time.monotonic())
        return outputs
    return step


def _engine_core_step(engine):
    """`engine.step` as `core_process.EngineCoreLoop` runs it: token ids only (the front end
    detokenizes), then the outputs and stats pickled for the pipe."""
    import pickle

    from carpool.engine.commands import EngineSnapshot
    from carpool.engine.core_messages import StepBatch

    engine.detokenize = False  # read by add_request and each step

    def step():
        outputs = engine.step()
        batch = StepBatch(outputs, EngineSnapshot(engine.stats(), time.monotonic(), 0),
                          time.monotonic())
        pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        return outputs
    return step


def _literal(text: str):
    """A Python literal (False, 2, 1e9), else the text itself (cuda, sdpa)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


if __name__ == "__main__":
    raise SystemExit(main())
