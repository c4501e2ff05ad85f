"""carpool against llama.cpp on the same GGUF files: single-stream greedy decode, alternated.

Each repeat runs, for every file, carpool (`benchmarks.compare`'s carpool worker, the offline
engine in its own process) and llama.cpp (`llama_cpp_speed`, one stream, one round, in the
Python that has `llama_cpp`), the order of the engines and files reversed on odd repeats so
that load from anything else on the machine falls on both. Both get the same prompt length,
128 new tokens and thread count; llama.cpp runs with OMP_WAIT_POLICY=PASSIVE (its OpenMP
threads otherwise spin on a shared machine, docs/lab/50), and carpool's worker the same by
default (`--spin-count 0`: PASSIVE, no spin; `carpool serve`'s own default spins 10,000
times first, docs/lab/21, which on an oversubscribed machine burns the cores the other
thread waits for). Decode tok/s excludes the prompt's
prefill on both sides: carpool's is (tokens - 1) / (last token - first token).

    python3 -m benchmarks.quant.vs_llama_cpp /tmp/moe-bf16.gguf /tmp/moe-f16.gguf --repeats 3

prints each repeat, then per file the median rates and the median of the per-repeat ratios.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.compare.vs_vllm import run_worker
from benchmarks.compare.vs_vllm_common import Job
from carpool.utils.cpu_threads import openmp_wait_environment

LLAMA_PYTHON = "/work/venv-llamacpp/bin/python"
PROMPT_LEN, NEW_TOKENS = 32, 128
ROOT = Path(__file__).resolve().parents[2]


def carpool_decode(file: str, dtype: str, threads: int, spin_count: int, workdir: Path,
                   tag: str) -> float:
    from carpool.models.config import load_model_config

    vocab = load_model_config(Path(file)).vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)]
    job = Job(engine="carpool", model=file, dtype=dtype, num_threads=threads,
              workloads={"1": [(prompt, NEW_TOKENS)]}, keep_token_ids=False)
    result = run_worker("carpool", job, sys.executable, workdir, tag, 1800,
                        extra_env=openmp_wait_environment(spin_count, {}))
    (request,) = result["workloads"]["1"]["requests"]
    return (request["num_output_tokens"] - 1) / (request["end_s"] - request["first_token_s"])


def llama_cpp_decode(file: str, threads: int, python: str) -> float:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    out = subprocess.run(
        [python, "-m", "benchmarks.quant.llama_cpp_speed", file, "--seqs", "1", "--rounds", "1",
         "--prompt-len", str(PROMPT_LEN), "--new-tokens", str(NEW_TOKENS),
         "--threads", str(threads)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=True).stdout
    return float(re.search(r"\s1 seq\s+([\d.]+) tok/s", out).group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="+")
    parser.add_argument("--dtype", default="bfloat16", help="carpool's activations' dtype")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--spin-count", type=int, default=0,
                        help="carpool's OpenMP spins before sleeping (GOMP_SPINCOUNT)")
    parser.add_argument("--llama-python", default=LLAMA_PYTHON)
    args = parser.parse_args()
    arms = [(file, engine) for file in args.gguf for engine in ("carpool", "llama.cpp")]
    rates: dict[tuple[str, str], list[float]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as workdir:
        for repeat in range(args.repeats):
            for i, (file, engine) in enumerate(arms if repeat % 2 == 0 else arms[::-1]):
                rate = (carpool_decode(file, args.dtype, args.threads, args.spin_count,
                                       Path(workdir), f"r{repeat}-{i}") if engine == "carpool"
                        else llama_cpp_decode(file, args.threads, args.llama_python))
                rates[file, engine].append(rate)
                print(f"repeat {repeat}: {engine:9s} {Path(file).name}: {rate:.1f} tok/s",
                      flush=True)
    print(f"\nthreads {args.threads}, prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens, carpool "
          f"{args.dtype} activations, spin count {args.spin_count}, median of {args.repeats}")
    # The ratio to trust on a shared machine: each repeat's pair ran back to back, under the
    # same load; the medians of the rates may come from repeats under different loads.
    print(f"{'file':40s} {'carpool':>9s} {'llama.cpp':>10s}  carpool / llama.cpp per repeat")
    for file in args.gguf:
        ours, theirs = rates[file, "carpool"], rates[file, "llama.cpp"]
        pairs = [a / b for a, b in zip(ours, theirs)]
        print(f"{Path(file).name:40s} {statistics.median(ours):9.1f} "
              f"{statistics.median(theirs):10.1f}  median {statistics.median(pairs):.2f} "
              f"({', '.join(f'{r:.2f}' for r in pairs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
