"""One stream on several models held in one process, alternated request by request: each
model's decode tok/s over the first model's, paired within the process.

`carpool_speed` runs each model in a subprocess of its own per repeat. On the shared Zen 4
machine a process's rate sits at one level for its whole life (bfloat16 34-36 or 40-48 tok/s
on the 0.5B shape) and the next process may draw another, so a ratio of two processes swings
with the levels they drew (docs/lab/60-stealable-column-splits-in-every-gemm.md). Here the
models share a process: each round runs the same request (a 32-token prompt, 128 greedy
tokens, the prefill step not timed) on every model in turn, and each process prints the
median over rounds of each model's rate and of its ratio to the first model's. `--processes`
runs that many such processes one after another.

    python3 -m benchmarks.quant.paired_one_stream /work/vs-vllm/0.5b-bfloat16 \\
        /work/gguf/0.5b-lc-Q4_K_M.gguf /work/gguf/0.5b-lc-Q8_0.gguf --rounds 8 --processes 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time

PROMPT_LEN, OUTPUT_LEN = 32, 128


def decode_rate(engine, request_id: str, prompt: list[int]) -> float:
    """Decode tok/s of one greedy request alone, from its first sampled token to its last."""
    from carpool.sampling_params import SamplingParams

    engine.add_request(request_id, prompt, SamplingParams(
        max_tokens=OUTPUT_LEN, min_tokens=OUTPUT_LEN, ignore_eos=True, temperature=0.0))
    engine.step()  # the prompt and the first token
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (OUTPUT_LEN - 1) / (time.perf_counter() - start)


def one_process(models: list[str], rounds: int, threads: int) -> str:
    import torch

    from carpool.llm import LLM
    from carpool.models.config import load_model_config

    torch.set_num_threads(threads)
    vocab = min(load_model_config(m).vocab_size for m in models)
    rng = random.Random(0)
    prompt = [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)]
    engines = [LLM(model=m, dtype="bfloat16", kv_cache_memory=2**29, seed=0).engine
               for m in models]
    for engine in engines:  # warm-up
        decode_rate(engine, "warm-up", prompt)
    rates = [[decode_rate(e, f"r{r}", prompt) for e in engines] for r in range(rounds)]
    per_model = list(zip(*rates))
    medians = [statistics.median(x) for x in per_model]
    paired = [statistics.median(a / b for a, b in zip(x, per_model[0])) for x in per_model[1:]]
    return ("tok/s " + " ".join(f"{m:.1f}" for m in medians)
            + "  paired / first " + " ".join(f"{p:.2f}" for p in paired))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="checkpoint folders or GGUF files; the first "
                        "is the baseline of the ratios")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        print(one_process(args.models, args.rounds, args.threads), flush=True)
        return 0
    print("models: " + ", ".join(args.models))
    for p in range(args.processes):
        out = subprocess.run([sys.executable, "-m", "benchmarks.quant.paired_one_stream",
                              *args.models, "--rounds", str(args.rounds), "--threads",
                              str(args.threads), "--inside"],
                             check=True, capture_output=True, text=True).stdout
        print(f"process {p}: {out.strip().splitlines()[-1]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
