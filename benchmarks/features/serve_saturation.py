"""Serving near saturation: how long is the latency tail when the server is almost full?

Starts a real `carpool serve` on a free loopback port, finds its capacity by
sending every request at once (`--request-rate inf`), then replays the same
requests as a Poisson stream at each of `--fractions` of that capacity,
`--repeat` times each, and reports E2E p99/p50 of each run with min / median / max.

    python3 -m benchmarks.features.serve_saturation --model /tmp/bench-llama \\
        --out-dir /tmp/serve-bench
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

from carpool.bench.local_server import LocalServer
from carpool.cli import main as carpool_main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Checkpoint folder to serve.")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--fractions", default="0.9,1.0",
                        help="Request rates to try, as fractions of capacity, comma-separated.")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--server-flags", default="--max-model-len 512 --max-num-waiting-requests 4096",
                        help="More `carpool serve` flags, as one string.")
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning",
             *shlex.split(args.server_flags)]
    print(f"server: carpool serve {args.model} {' '.join(flags)}", flush=True)
    with LocalServer(args.model, flags, out / "server.log") as base_url:
        load = ["bench", "serve", "--base-url", base_url, "--tokenizer", args.model,
                "--workload", "random", "--num-prompts", str(args.num_prompts),
                "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                "--ignore-eos", "--no-progress"]
        capacity = _run(load + ["--request-rate", "inf"], out / "capacity.json")["request_throughput"]
        runs = {}
        for fraction in (float(f) for f in args.fractions.split(",")):
            rate = round(fraction * capacity, 3)
            runs[fraction] = [_run(load + ["--request-rate", str(rate)], out / f"rate{rate}_run{i + 1}.json")
                              for i in range(args.repeat)]
    print(f"\ncapacity {capacity:.3f} req/s (all {args.num_prompts} requests at once)")
    summary = {"capacity_req_s": capacity, "fractions": {}}
    for fraction, fraction_runs in runs.items():
        _report(fraction, capacity, fraction_runs)
        summary["fractions"][str(fraction)] = [r["e2el"]["p99_over_p50"] for r in fraction_runs]
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def _report(fraction: float, capacity: float, runs: list[dict]) -> None:
    ratios = [r["e2el"]["p99_over_p50"] for r in runs]
    print(f"Poisson rate {fraction * capacity:.3f} req/s = {fraction:.0%} of capacity:")
    for i, r in enumerate(runs, 1):
        print(f"  run {i}: E2E p50 {r['e2el']['median_ms']:.0f} ms, p99 {r['e2el']['p99_ms']:.0f} ms, "
              f"p99/p50 {r['e2el']['p99_over_p50']:.2f}, {r['output_throughput']:.1f} out tok/s, "
              f"peak concurrency {r['peak_concurrency']}")
    print(f"  E2E p99/p50: median {statistics.median(ratios):.2f} "
          f"[min {min(ratios):.2f}, max {max(ratios):.2f}]")


def _run(argv: list[str], result_file: Path) -> dict:
    argv = argv + ["--result-file", str(result_file)]
    print("\n$ carpool " + " ".join(shlex.quote(a) for a in argv), flush=True)
    if carpool_main(argv) != 0:
        raise SystemExit(f"carpool {' '.join(argv[:2])} failed")
    return json.loads(result_file.read_text())


if __name__ == "__main__":
    sys.exit(main())
