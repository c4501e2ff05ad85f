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

With `--num-requests N` it runs issue 8's batch workload instead (`vs_vllm.build_requests`: N
requests added at once, prompts of 16-512 tokens, outputs of 16-32 or 128-256), both engines
through `benchmarks.compare`'s step loop: carpool's worker, and llama.cpp's
(`vs_vllm_worker_llama_cpp`, the server's slot loop over the library: every request a
sequence, one `llama_decode` a step of up to 4,096 tokens, decodes first). Output tok/s over
the whole workload (prefill included) and TTFT p50, per repeat:

    python3 -m benchmarks.quant.vs_llama_cpp 0.5b-lc-Q8_0.gguf --num-requests 200 --repeats 2
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

from benchmarks.compare.vs_vllm import build_requests, run_worker, summarize_run
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


def batch_run(engine: str, file: str, requests: list, dtype: str, threads: int,
              spin_count: int, python: str, workdir: Path, tag: str) -> dict:
    """One engine's run of the batch workload: `vs_vllm.summarize_run`'s figures."""
    job = Job(engine=engine, model=file, dtype=dtype, num_threads=threads,
              workloads={"batch": requests}, keep_token_ids=False)
    env = (openmp_wait_environment(spin_count, {}) if engine == "carpool"
           else {"OMP_WAIT_POLICY": "PASSIVE"})
    result = run_worker(engine, job, sys.executable if engine == "carpool" else python,
                        workdir, tag, 3600, extra_env=env)
    return summarize_run(result["workloads"]["batch"])


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
    parser.add_argument("--num-requests", type=int, default=0,
                        help="run issue 8's batch workload of this many requests instead")
    args = parser.parse_args()
    if args.num_requests:
        return batch_main(args)
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


def batch_main(args) -> int:
    from carpool.models.config import load_model_config

    arms = [(file, engine) for file in args.gguf for engine in ("carpool", "llama.cpp")]
    runs: dict[tuple[str, str], list[dict]] = {arm: [] for arm in arms}
    requests = {file: build_requests(args.num_requests, load_model_config(Path(file)).vocab_size)
                for file in args.gguf}
    with tempfile.TemporaryDirectory() as workdir:
        for repeat in range(args.repeats):
            for i, (file, engine) in enumerate(arms if repeat % 2 == 0 else arms[::-1]):
                run = batch_run(engine, file, requests[file], args.dtype, args.threads,
                                args.spin_count, args.llama_python, Path(workdir),
                                f"r{repeat}-{i}")
                runs[file, engine].append(run)
                print(f"repeat {repeat}: {engine:9s} {Path(file).name}: "
                      f"{run['output_tok_s']:.1f} out tok/s, TTFT p50 "
                      f"{run['ttft_p50_ms']:.0f} ms", flush=True)
    print(f"\nthreads {args.threads}, {args.num_requests} requests (issue 8's workload), "
          f"carpool spin count {args.spin_count}, llama.cpp OMP_WAIT_POLICY=PASSIVE")
    print(f"{'file':32s} {'carpool':>9s} {'llama.cpp':>10s}  tok/s ratio per repeat; "
          f"TTFT p50 ratio per repeat")
    for file in args.gguf:
        ours, theirs = runs[file, "carpool"], runs[file, "llama.cpp"]
        tok = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(ours, theirs)]
        ttft = [a["ttft_p50_ms"] / b["ttft_p50_ms"] for a, b in zip(ours, theirs)]
        print(f"{Path(file).name:32s} {statistics.median(r['output_tok_s'] for r in ours):9.1f} "
              f"{statistics.median(r['output_tok_s'] for r in theirs):10.1f}  "
              f"{', '.join(f'{r:.2f}' for r in tok)}; {', '.join(f'{r:.2f}' for r in ttft)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
