"""The fused experts kernel (`moe_experts`) per layer against the dense MLP of the same active
size (issue 63): the 135M-moe shape's experts (16 of intermediate 384, top 4, hidden 576)
against the dense 135M MLP (intermediate 1,536) through the small GEMMs, bfloat16.

`--layers` copies of each layer's weights are cycled, so every call reads its weights from
memory as a model's decode does; the two alternate, best of `--repeats`. At one row the
experts read exactly the dense MLP's bytes; from a few rows most experts are touched.

    python3 -m benchmarks.kernels.moe_experts --threads 1
    python3 -m benchmarks.kernels.moe_experts --threads 1 --clock cpu   # a loaded machine

`--clock cpu` times the process's CPU time instead of the wall: on a machine other jobs
load, a 1-thread run's CPU time is its own work (less what they cost its caches).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

from carpool import kernels as cpu_kernels
from carpool.platform.cpu_linear import PackedLinear
from carpool.platform.cpu_route import CpuFacts, KernelFacts, decide_linears


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    kernels = cpu_kernels.load()
    if kernels is None:
        print("the C++ kernels could not be built here")
        return 1
    torch.set_num_threads(args.threads)
    hidden, inner, experts, top_k, dense_inner = 576, 384, 16, 4, 1536
    dtype = torch.bfloat16
    route = decide_linears(CpuFacts.probe(), dtype, KernelFacts.of(kernels, 64))
    moe = [kernels.pack_moe_experts((torch.randn(experts, 2 * inner, hidden) / 24).to(dtype),
                                    (torch.randn(experts, hidden, inner) / 20).to(dtype))
           for _ in range(args.layers)]
    dense = [(PackedLinear(nn.Linear(hidden, 2 * dense_inner, bias=False).to(dtype), kernels,
                           route),
              PackedLinear(nn.Linear(dense_inner, hidden, bias=False).to(dtype), kernels, route))
             for _ in range(args.layers)]
    for rows in args.rows:
        x = torch.randn(rows, hidden).to(dtype)
        ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(rows)])
        weights = torch.softmax(torch.randn(rows, top_k), -1)
        times: dict[str, list[float]] = {"moe": [], "dense": []}
        for _ in range(args.repeats):
            start = clock()
            for gate_up, down in moe:
                kernels.moe_experts(x, gate_up, down, ids, weights)
            times["moe"].append(clock() - start)
            start = clock()
            for gate_up, down in dense:
                down(kernels.silu_and_mul(gate_up(x)))
            times["dense"].append(clock() - start)
        m, d = (min(times[k]) / args.layers * 1e6 for k in ("moe", "dense"))
        print(f"rows {rows}: moe_experts {m:.0f} us a layer, dense MLP {d:.0f} us, "
              f"moe / dense {m / d:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
