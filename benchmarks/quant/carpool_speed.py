"""carpool on quantized weights against carpool on bfloat16 weights: single-stream decode and
the 200-request workload, same machine, same threads, alternated in one run.

Each model (a checkpoint folder or a GGUF file) runs in its own subprocess through
`benchmarks.compare`'s carpool worker (the offline engine stepped by hand, every output
timestamped), in the order given on even repeats and reversed on odd ones, so that load from
anything else on the machine falls on all of them. Workloads:

- "1": one request, a 32-token prompt, 128 tokens out (greedy, ignore_eos): decode tok/s at
  one stream, where the weights' bytes read per token set the speed;
- "200": issue 8's workload (`benchmarks.compare.vs_vllm.build_requests`): 200 requests at
  once, prompts of 16-512 tokens, outputs of 16-32 or 128-256 tokens.

    python3 -m benchmarks.quant.carpool_speed /work/vs-vllm/0.5b-bfloat16 \\
        /work/gguf/0.5b-Q8_0.gguf /work/gguf/0.5b-Q4_K_M.gguf --repeats 3

prints tok/s per model and workload (median of the repeats) and each one's ratio to the first
model's.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from benchmarks.compare.vs_vllm import aggregate, build_requests, run_worker, summarize_run
from benchmarks.compare.vs_vllm_common import Job

SINGLE_PROMPT_LEN, SINGLE_OUTPUT_LEN = 32, 128


def workloads(vocab_size: int, num_requests: int, seed: int = 0) -> dict:
    """The single stream, and the `num_requests` workload unless it is 0."""
    rng = random.Random(seed)
    single = [([rng.randrange(3, vocab_size) for _ in range(SINGLE_PROMPT_LEN)],
               SINGLE_OUTPUT_LEN)]
    if not num_requests:
        return {"1": single}
    return {"1": single, str(num_requests): build_requests(num_requests, vocab_size, seed)}


def vocab_size_of(model: str) -> int:
    from carpool.models.config import load_model_config
    return load_model_config(Path(model)).vocab_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="checkpoint folders or GGUF files; the first "
                        "is the baseline of the ratios")
    parser.add_argument("--dtype", default="bfloat16", help="activations' dtype (all models)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=200,
                        help="the batch workload's size (0: the single stream only)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    vocab = min(vocab_size_of(m) for m in args.models)
    jobs_workloads = workloads(vocab, args.num_requests)
    runs: dict[str, dict[str, list[dict]]] = {m: {} for m in args.models}
    with tempfile.TemporaryDirectory() as workdir:
        for repeat in range(args.repeats):
            order = args.models if repeat % 2 == 0 else args.models[::-1]
            for i, model in enumerate(order):
                job = Job(engine="carpool", model=model, dtype=args.dtype,
                          num_threads=args.threads, workloads=jobs_workloads,
                          keep_token_ids=False)
                result = run_worker("carpool", job, sys.executable, Path(workdir),
                                    f"r{repeat}-{i}", args.timeout)
                for name, run in result["workloads"].items():
                    runs[model].setdefault(name, []).append(summarize_run(run))
                print(f"repeat {repeat}: {model}: " + ", ".join(
                    f"{name} {runs[model][name][-1]['output_tok_s']:.1f} tok/s"
                    for name in result["workloads"]), flush=True)
    summary = {m: {name: aggregate(r) for name, r in per.items()} for m, per in runs.items()}
    base = args.models[0]
    print(f"\n{'model':60s} {'workload':>8s} {'tok/s':>9s} {'x base':>7s} {'TTFT p50':>9s}")
    for model in args.models:
        for name, agg in summary[model].items():
            ratio = agg["tok_s_median"] / summary[base][name]["tok_s_median"]
            print(f"{model:60s} {name:>8s} {agg['tok_s_median']:9.1f} {ratio:7.2f} "
                  f"{agg['ttft_p50_ms']:8.0f}ms")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
