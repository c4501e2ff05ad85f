"""Decode speed of a mixture of experts against a dense model of the same active size (issue 63).

Both models load in one process with the same threads; each round runs the same decode
workload through each (alternated: the MoE first on even rounds, the dense model on odd
ones), so load from elsewhere falls on both, and the ratio dense / MoE of each round's tokens
per second is the number to trust on a shared machine. Workloads: one stream (a 16-token
prompt, --max-tokens out) and a batch (--batch requests of 16-token prompts, --max-tokens
out each, added at once); greedy, exactly that many tokens, prefix caching off. The time
of `generate` (the models load and warm up before the clock): wall time, or with `--clock
cpu` the process's CPU time, which other jobs on a shared machine disturb far less (with
`--threads 1`, where no thread spins at a barrier, it is the work itself).

    python3 -m benchmarks.features.moe_decode /tmp/vs-vllm/135m-moe-bfloat16 \
        /tmp/vs-vllm/135m-bfloat16 --rounds 3
    python3 -m benchmarks.features.moe_decode /tmp/vs-vllm/135m-moe-bfloat16 \
        /tmp/vs-vllm/135m-bfloat16 --rounds 3 --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from carpool import LLM, SamplingParams

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def run(llm: LLM, num_requests: int, max_tokens: int, seed: int, clock=time.perf_counter) -> float:
    """Output tokens per second of `num_requests` 16-token prompts decoding `max_tokens`."""
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 49000) for _ in range(16)]}
               for _ in range(num_requests)]
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0,
                            ignore_eos=True)
    start = clock()
    llm.generate(prompts, params, use_tqdm=False)
    return num_requests * max_tokens / (clock() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("moe")
    parser.add_argument("dense")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: "
                        "torch's own)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = CLOCKS[args.clock]
    llms = {name: LLM(path, dtype=args.dtype, enable_prefix_caching=False, num_kv_blocks=1024)
            for name, path in (("moe", args.moe), ("dense", args.dense))}
    for llm in llms.values():  # warm-up: oneDNN's primitives, the kernels' first calls
        run(llm, 4, 8, seed=99)
    print(f"{torch.get_num_threads()} threads, {args.clock} clock (tok/s per {args.clock} second)")
    ratios: dict[str, list[float]] = {"stream": [], "batch": []}
    for r in range(args.rounds):
        order = ["moe", "dense"] if r % 2 == 0 else ["dense", "moe"]
        for kind, num in (("stream", 1), ("batch", args.batch)):
            rate = {name: run(llms[name], num, args.max_tokens, seed=r, clock=clock)
                    for name in order}
            ratios[kind].append(rate["dense"] / rate["moe"])
            print(f"round {r} {kind}: moe {rate['moe']:.1f} tok/s, dense {rate['dense']:.1f} "
                  f"tok/s, dense/moe {ratios[kind][-1]:.2f}x", flush=True)
    for kind, values in ratios.items():
        print(f"{kind}: dense/moe median {statistics.median(values):.2f}x "
              f"({', '.join(f'{v:.2f}' for v in values)})")
    for llm in llms.values():
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
