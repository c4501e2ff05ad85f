"""What batch-invariant mode costs (issue 19): output throughput with and without it.

The same seeded workload runs through `LLM(model, batch_invariant=False)` and
`LLM(model, batch_invariant=True)`, alternated (off first on even rounds, on first on odd
ones) in one process with the same thread count, so load from elsewhere falls on both;
the ratio on / off of each round is the number to trust on a shared machine. Workload:
issue 8's shape scaled down: N requests added at once, prompt lengths uniform in
[16, --max-prompt] of random token ids, output lengths half uniform in [16, 32] and half in
[--long-output / 2, --long-output], exactly that many tokens out, greedy, prefix caching off.
Timed by the process's CPU time (`time.process_time`: on a shared, loaded machine the wall
clock mostly measures waits for a core; run with OMP_NUM_THREADS=1 so that a spinning second
thread does not count), wall time printed beside it. Timing covers `generate` only (the
model loads before the clock starts); one untimed round of both modes first warms oneDNN's
primitive cache (one JIT-compiled kernel per row count, process-wide), which the default
mode's many row buckets would otherwise pay inside its first timed run.

    OMP_NUM_THREADS=1 python3 -m benchmarks.features.batch_invariance_cost \
        /tmp/vs-vllm/tiny-float32 /tmp/vs-vllm/135m-bfloat16
    # one request at a time: a 64-token prompt, 64 tokens out, twice
    OMP_NUM_THREADS=1 python3 -m benchmarks.features.batch_invariance_cost \
        /tmp/vs-vllm/135m-bfloat16 --alone
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from carpool import LLM, SamplingParams


def workload(seed: int, num_requests: int, max_prompt: int, long_output: int,
             vocab_size: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    outputs = [rng.randint(16, 32) for _ in range(num_requests // 2)]
    outputs += [rng.randint(long_output // 2, long_output)
                for _ in range(num_requests - len(outputs))]
    rng.shuffle(outputs)
    prompts = [{"prompt_token_ids": [rng.randrange(10, vocab_size)
                                     for _ in range(rng.randint(16, max_prompt))]}
               for _ in range(num_requests)]
    params = [SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
              for n in outputs]
    return prompts, params


def alone_workload(vocab_size: int) -> tuple[list[dict], list[SamplingParams]]:
    """One request of a 64-token prompt and 64 tokens out, sent twice (one after the other)."""
    prompt = {"prompt_token_ids": [10 + i % (vocab_size - 10) for i in range(64)]}
    return [prompt], [SamplingParams(max_tokens=64, min_tokens=64, temperature=0.0,
                                     ignore_eos=True)]


def output_throughput(model: str, invariant: bool, prompts, params) -> tuple[float, float]:
    """Output tokens per CPU second and per wall second of one `generate` over the workload."""
    with LLM(model, batch_invariant=invariant, enable_prefix_caching=False) as llm:
        cpu, wall = time.process_time(), time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        if len(prompts) == 1:  # --alone: a second time, one after the other
            outputs += llm.generate(prompts, params, use_tqdm=False)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return num_tokens / cpu, num_tokens / wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="checkpoint folders")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--long-output", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--alone", action="store_true",
                        help="one request at a time instead of the batch workload")
    parser.add_argument("--vocab-limit", type=int, default=4000,
                        help="prompt token ids are drawn below this (within every model's)")
    args = parser.parse_args()
    for model in args.models:
        prompts, params = (alone_workload(args.vocab_limit) if args.alone else
                           workload(args.seed, args.num_requests, args.max_prompt,
                                    args.long_output, args.vocab_limit))
        for mode in (False, True):  # warm-up, untimed
            output_throughput(model, mode, prompts, params)
        ratios = []
        for round_index in range(args.rounds):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            figures = {mode: output_throughput(model, mode, prompts, params) for mode in order}
            (off_cpu, off_wall), (on_cpu, on_wall) = figures[False], figures[True]
            ratios.append(on_cpu / off_cpu)
            print(f"{model} round {round_index + 1}: output tok per CPU s off {off_cpu:.1f}, "
                  f"on {on_cpu:.1f}, on/off {ratios[-1]:.3f} (wall: off {off_wall:.1f}, "
                  f"on {on_wall:.1f} tok/s, on/off {on_wall / off_wall:.3f})", flush=True)
        print(f"{model}: CPU-time on/off median {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
