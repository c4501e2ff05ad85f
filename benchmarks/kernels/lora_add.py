"""`lora_add_` against the base linears it follows, on one layer of a model's shape: a step
of `--rows` rows spread evenly over `--adapters` rank-`--rank` adapters on every
q/k/v/o/gate/up/down module (the lora_adapters benchmark's workload), in the model's dtype.

Prints, per linear, the base product's time (the small GEMM up to its row limit, else
torch's matmul, as the layer stack runs it) and the LoRA term's, and the layer's ratio.
`--old` names another build's .so (an earlier commit's, from the extension cache) to time
its `lora_add_` beside this checkout's, alternated in one run.

    python3 -m benchmarks.kernels.lora_add --rows 200 --threads 2
    python3 -m benchmarks.kernels.lora_add --rows 4096 --threads 2
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import time

import torch

from carpool import kernels as cpu_kernels

# the 135M shape: hidden 576, q 576, k/v 192, intermediate 1536
LINEARS = {"qkv": (576, (576, 192, 192)), "o": (576, (576,)), "gate_up": (576, (1536, 1536)),
           "down": (1536, (576,))}


def terms(rows: int, adapters: int, rank: int, dtype: torch.dtype, gen: torch.Generator):
    """linear -> (out, x, starts, ends, a, b, parts): every row on an adapter, in equal
    slices."""
    bounds = [rows * g // adapters for g in range(adapters + 1)]
    made = {}
    for name, (in_features, outs) in LINEARS.items():
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        out = torch.randn(rows, sum(outs), generator=gen).to(dtype)
        a, b, parts = [], [], []
        for g in range(adapters):
            a.append((torch.randn(in_features, rank * len(outs), generator=gen) * 0.05).to(dtype))
            col = 0
            for i, cols in enumerate(outs):
                b.append((torch.randn(rank, cols, generator=gen) * 0.05).to(dtype))
                parts += [g, col, i * rank, (i + 1) * rank]
                col += cols
        made[name] = (out, x, bounds[:-1], bounds[1:], a, b, parts)
    return made


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--old", default=None, help="an earlier build's .so to time beside")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kernels = cpu_kernels.load()
    arms = {"new": kernels}
    if args.old:
        spec = importlib.util.spec_from_file_location(args.old.rsplit("/", 1)[-1][:-3],
                                                      args.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        arms = {"old": old, "new": kernels}
    gen = torch.Generator().manual_seed(0)
    cases = terms(args.rows, args.adapters, args.rank, dtype, gen)
    total = {name: 0.0 for name in ["base", *arms]}
    for name, (out, x, starts, ends, a, b, parts) in cases.items():
        weight = torch.randn(out.shape[1], x.shape[1], generator=gen).to(dtype)
        base = best_of(functools.partial(torch.nn.functional.linear, x, weight), args.repeats)
        line = f"{name:8s} base {base * 1e3:8.3f} ms"
        total["base"] += base
        for arm, module in arms.items():
            work = out.clone()
            t = best_of(functools.partial(module.lora_add_, work, x, starts, ends, a, b, parts),
                        args.repeats)
            total[arm] += t
            line += f"  {arm} {t * 1e3:8.3f} ms ({t / base:.3f}x base)"
        print(line, flush=True)
    line = f"{'layer':8s} base {total['base'] * 1e3:8.3f} ms"
    for arm in arms:
        line += f"  {arm} {total[arm] * 1e3:8.3f} ms ({total[arm] / total['base']:.3f}x base)"
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
