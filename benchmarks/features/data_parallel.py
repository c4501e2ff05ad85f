"""`carpool bench serve` against one server with --data-parallel-size 1 and then 2, alternated.

Each variant is a fresh `carpool serve` (same flags but -dp): one engine process
with all of torch's threads, or two replicas with half of them each (their own KV
pools, `runner_setup.place_replica`). The same random workload (fixed seed) is sent
all at once; the table gives output throughput and TTFT per run, plus the load
average when the run started, since the machine is shared. Compare within a round.

    python3 -m benchmarks.features.data_parallel /tmp/vs-vllm/135m-bfloat16 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SERVER_FLAGS = ["--max-model-len", "1024", "--max-num-seqs", "32", "--num-kv-blocks", "512",
                "--disable-log-stats"]


def run_variant(model: str, dp: int, args: argparse.Namespace, work: Path) -> dict:
    from carpool.bench.local_server import LocalServer

    log = work / f"server-dp{dp}.log"
    result_file = work / f"dp{dp}.json"
    load = os.getloadavg()[0]
    with LocalServer(model, [*SERVER_FLAGS, "--data-parallel-size", str(dp)], log) as url:
        subprocess.run(
            [sys.executable, "-m", "carpool.cli", "bench", "serve", "--base-url", url,
             "--workload", "random", "--num-prompts", str(args.num_prompts),
             "--input-len", str(args.input_len), "--output-len", str(args.output_len),
             "--ignore-eos", "--temperature", "0", "--tokenizer", model, "--no-progress",
             "--result-file", str(result_file)],
            check=True, stdout=subprocess.DEVNULL, env=dict(os.environ))
    result = json.loads(result_file.read_text())
    return {"dp": dp, "load": load, "failed": result["num_failed"],
            "duration_s": result["duration_s"], "output_tok_s": result["output_throughput"],
            "ttft_mean_ms": result["ttft"]["mean_ms"], "ttft_p50_ms": result["ttft"]["median_ms"],
            "ttft_p99_ms": result["ttft"]["p99_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    print("| round | -dp | load avg at start | duration (s) | output tok/s | TTFT mean (ms) "
          "| TTFT p50 (ms) | TTFT p99 (ms) | failed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            order = (1, 2) if round_index % 2 == 0 else (2, 1)
            for dp in order:
                r = run_variant(args.model, dp, args, Path(tmp))
                print(f"| {round_index + 1} | {dp} | {r['load']:.1f} | {r['duration_s']:.1f} "
                      f"| {r['output_tok_s']:.1f} | {r['ttft_mean_ms']:.0f} "
                      f"| {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['failed']} |",
                      flush=True)


if __name__ == "__main__":
    main()
