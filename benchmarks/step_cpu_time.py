"""CPU time of the prefill and of a decode step: commits or settings compared on a busy machine.

Adds N requests (random prompts of 16-512 tokens, 32 output tokens each, greedy,
ignore_eos) to one engine, steps until every request has its first token (the
prefill phase), then runs the decodes to the end. Prints the process CPU time of the
prefill phase and the median CPU time of a decode step: on a shared machine CPU
time moves far less with other load than the wall clock does. Use one thread
(`--threads 1`, the default) and OMP_WAIT_POLICY=PASSIVE, and alternate the sides.

To compare commits, check the older one out in a worktree and put it first on
sys.path with `--tree` (the script only passes engine arguments that are given,
so older commits that lack a newer argument still run):

    git worktree add /tmp/base <commit>
    OMP_WAIT_POLICY=PASSIVE python3 benchmarks/step_cpu_time.py /tmp/vs-vllm/135m-bfloat16 \\
        --dtype bfloat16 --requests 40 --tree /tmp/base
    OMP_WAIT_POLICY=PASSIVE python3 benchmarks/step_cpu_time.py /tmp/vs-vllm/135m-bfloat16 \\
        --dtype bfloat16 --requests 40 --engine-arg cpu_kernels=False
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
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent),
                        help="carpool checkout to import (default: this one)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="an extra LLM(...) argument, e.g. cpu_kernels=False (repeatable)")
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.tree)

    import torch

    from carpool import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    extra = {}
    for item in args.engine_arg:
        name, _, value = item.partition("=")
        extra[name] = ast.literal_eval(value)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=256, max_num_batched_tokens=2048,
              kv_cache_memory=2 << 30, device="cpu", **extra)
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len,
                            ignore_eos=True, temperature=0.0)
    begin = time.process_time()
    for i in range(args.requests):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(16, 512))]
        engine.add_request(f"r{i}", prompt, params)
    started: set[str] = set()
    while len(started) < args.requests:
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    prefill = time.process_time() - begin
    steps = []
    while engine.has_unfinished_requests():
        begin = time.process_time()
        engine.step()
        steps.append(time.process_time() - begin)
    print(f"{args.label or Path(args.tree).name} {Path(args.model).name} "
          f"{args.requests} requests: prefill CPU {prefill:.2f} s, decode step CPU p50 "
          f"{1000 * statistics.median(steps):.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
