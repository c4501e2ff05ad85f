"""carpool's CPU time on `vs_vllm.py`'s workload by kind of work, from a `perf` profile, beside
the least the workload's linears can take on this CPU.

The C++ layer stack runs every decoder layer in one call, so Python-side timers
(`engine_time_split.py --kernel-times`) cannot split a step; a sampling profiler sees each
kernel's symbol. Record carpool alone on the workload, then split the samples:

    perf record -e cpu-clock -F 400 -o /tmp/carpool.perf -- \\
        python3 -m benchmarks.profile.engine_time_split /tmp/vs-vllm/135m-bfloat16
    python3 -m benchmarks.profile.perf_split /tmp/vs-vllm/135m-bfloat16 /tmp/carpool.perf

Each sample is CPU time of one thread, so the split does not depend on what else shares the
machine, except "OpenMP waits" (a thread spinning at a barrier while its partner is off the
CPU: the machine's load more than carpool's). What the workload must do is counted from the
checkpoint's config and the same seeded requests: the linears' multiply-adds (prompt rows,
decode rows, the LM head on sampled rows), the prompts' causal attention, the bytes of KV
cache the decode rows read. The floor is the linears alone at the rate oneDNN reaches on one
core here (a [4096, K] x [K, N] bfloat16 product on the model's shapes, timed on this thread's
CPU clock), and the ceiling it gives the output tok/s at `--threads` cores: no other work, no
waits. The profile also holds the start (model load, the KV cache's first touch, which shows
as the kernel's page clearing, and a 4-request warm-up): small beside the run, listed apart.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.compare.vs_vllm import build_requests

# (kind, test on (shared object, symbol)), first match wins.
KINDS: list[tuple[str, object]] = [
    ("OpenMP waits (idle / sync)", lambda dso, sym: "gomp" in dso or "iomp" in dso),
    ("linears, oneDNN (prompt steps)", lambda dso, sym: dso.startswith("[JIT]")
     or "dnnl" in sym or "brgemm" in sym),
    ("linears, small GEMM (decode steps, LM head)", lambda dso, sym: "carpool_gemm::" in sym),
    ("attention, decode rows", lambda dso, sym: "carpool_cpu::" in sym
     or "paged_attention" in sym),
    ("attention, prompt rows", lambda dso, sym: "carpool_prefill::" in sym),
    ("sampling (argmax)", lambda dso, sym: "carpool_greedy" in sym),
    ("elementwise (RMSNorm, RoPE, SiLU, KV write)", lambda dso, sym: "carpool_fused" in sym),
    ("kernel: page clearing (first touch)", lambda dso, sym: "clear_page" in sym),
    ("kernel: other", lambda dso, sym: "kernel" in dso),
    ("carpool kernels: other (layer stack, glue)", lambda dso, sym: "carpool_cpu_kernels" in dso),
    ("host: Python, torch, libc", lambda dso, sym: True),
]


@dataclass(frozen=True)
class Work:
    """What the workload must compute: multiply-adds x 2 (FLOP) and KV bytes read."""

    prompt_tokens: int
    output_tokens: int
    prompt_linear_flop: float
    decode_linear_flop: float
    lm_head_flop: float
    prompt_attention_flop: float
    decode_kv_bytes: float

    @property
    def linear_flop(self) -> float:
        return self.prompt_linear_flop + self.decode_linear_flop + self.lm_head_flop


def layer_shapes(c: dict) -> list[tuple[int, int]]:
    """The (in, out) shapes of one decoder layer's linears of the Llama config `c` (q, k and v
    as one, gate and up as one, as carpool packs them)."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", heads)
    d = c.get("head_dim", h // heads)
    return [(h, (heads + 2 * kv_heads) * d), (heads * d, h), (h, 2 * c["intermediate_size"]),
            (c["intermediate_size"], h)]


def row_flop(c: dict) -> int:
    """FLOP of one row through every decoder layer's linears of the Llama config `c`."""
    return 2 * c["num_hidden_layers"] * sum(i * o for i, o in layer_shapes(c))


def workload(model: str, num_requests: int, seed: int) -> tuple[Work, list[tuple[int, int]]]:
    """The work of `vs_vllm.py`'s requests on the Llama-shaped checkpoint `model`, and its
    decoder layer's linear shapes (`layer_shapes`)."""
    c = json.loads((Path(model) / "config.json").read_text())
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", heads)
    d = c.get("head_dim", h // heads)
    bytes_per = 4 if c.get("torch_dtype") == "float32" else 2
    shapes, per_row = layer_shapes(c), row_flop(c)
    requests = build_requests(num_requests, c["vocab_size"], seed)
    prompt = sum(len(ids) for ids, _ in requests)
    out = sum(n for _, n in requests)
    pairs = sum(len(ids) * (len(ids) + 1) / 2 for ids, _ in requests)  # causal (query, key)
    contexts = sum(len(ids) + k for ids, n in requests for k in range(1, n))  # decode rows' keys
    return Work(prompt_tokens=prompt, output_tokens=out,
                prompt_linear_flop=prompt * per_row,
                decode_linear_flop=(out - len(requests)) * per_row,
                lm_head_flop=out * 2 * h * c["vocab_size"],
                prompt_attention_flop=pairs * layers * heads * d * 4,
                decode_kv_bytes=contexts * layers * kv_heads * d * 2 * bytes_per), shapes


def onednn_rate(shapes: list[tuple[int, int]], rows: int = 4096, repeats: int = 5) -> float:
    """FLOP a CPU second of bfloat16 F.linear (oneDNN) over one layer's shapes at `rows` rows on
    one thread, best of `repeats`, on this thread's CPU clock."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        flop = seconds = 0.0
        for i, o in shapes:
            x, w = torch.randn(rows, i).bfloat16(), torch.randn(o, i).bfloat16()
            F.linear(x, w)
            best = float("inf")
            for _ in range(repeats):
                begin = time.thread_time()
                F.linear(x, w)
                best = min(best, time.thread_time() - begin)
            flop += 2 * rows * i * o
            seconds += best
        return flop / seconds
    finally:
        torch.set_num_threads(threads)


def split(perf_data: str) -> collections.Counter:
    """CPU seconds by kind (KINDS) in a `perf record -e cpu-clock` profile."""
    report = subprocess.run(
        ["perf", "report", "-i", perf_data, "--no-children", "-g", "none", "--stdio",
         "-t", "\t", "-F", "period,dso,sym"], capture_output=True, text=True, check=True).stdout
    seconds: collections.Counter = collections.Counter()
    for line in report.splitlines():
        fields = line.split("\t")
        if line.startswith("#") or len(fields) != 3:
            continue
        period, dso, sym = int(fields[0]), fields[1].strip(), fields[2].strip()
        kind = next(name for name, test in KINDS if test(dso, sym))
        seconds[kind] += period * 1e-9  # cpu-clock periods are nanoseconds
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the checkpoint the profile ran (its config.json)")
    parser.add_argument("perf_data", nargs="?", help="a `perf record -e cpu-clock` file; "
                        "without it, only the workload's work and floor")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="cores, for the ceiling")
    args = parser.parse_args()
    work, shapes = workload(args.model, args.requests, args.seed)
    rate = onednn_rate(shapes)
    floor = work.linear_flop / rate
    print(f"{args.requests} requests: {work.prompt_tokens} prompt tokens, {work.output_tokens} "
          f"output tokens")
    print(f"  linears {work.linear_flop / 1e12:.2f} TFLOP (prompt rows "
          f"{work.prompt_linear_flop / 1e12:.2f}, decode rows {work.decode_linear_flop / 1e12:.2f}"
          f", LM head {work.lm_head_flop / 1e12:.2f}); prompt attention "
          f"{work.prompt_attention_flop / 1e9:.0f} GFLOP; decode rows read "
          f"{work.decode_kv_bytes / 1e9:.0f} GB of KV cache")
    print(f"  oneDNN here: {rate / 1e9:.0f} GFLOP a CPU second on one core; the linears alone at "
          f"that rate: {floor:.1f} CPU s, a ceiling of "
          f"{work.output_tokens * args.threads / floor:.0f} out tok/s on {args.threads} cores")
    if args.perf_data is None:
        return
    seconds = split(args.perf_data)
    total = sum(seconds.values())
    waits = seconds[KINDS[0][0]]
    print(f"  {'kind':46} {'CPU s':>8} {'of all':>7} {'of work':>8}")
    for kind, _ in KINDS:
        spent = seconds[kind]
        share = "" if kind == KINDS[0][0] else f"{spent / (total - waits):8.1%}"
        print(f"  {kind:46} {spent:8.1f} {spent / total:7.1%} {share}")
    linears = seconds[KINDS[1][0]] + seconds[KINDS[2][0]]
    print(f"  linears at {work.linear_flop / linears / 1e9:.0f} GFLOP a CPU second "
          f"({work.linear_flop / linears / rate:.0%} of oneDNN's rate here); prompt attention "
          f"at {work.prompt_attention_flop / max(1e-9, seconds[KINDS[4][0]]) / 1e9:.0f}; decode "
          f"attention reads {work.decode_kv_bytes / max(1e-9, seconds[KINDS[3][0]]) / 1e9:.1f} "
          f"GB a CPU second")


if __name__ == "__main__":
    main()
