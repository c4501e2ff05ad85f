"""How mid-size linear calls should run: 512-row pieces, one padded oneDNN call, or the
compiled small GEMM, on the 135M model's four layer shapes, `--copies` times over.

For each row count, one pass over the layers through each side, alternated, min of
`--repeats`: `pieces` (oneDNN on 512-row pieces, bucketed, then `torch.cat`: the path
above the small GEMM's cut before BENCHMARKS §26), `padded` (one oneDNN call on the rows
zero-padded to whole 512s), `small` (`small_gemm_bf16(amx=True)` / `small_gemm_f32`, where
the build has it), `routed` (`PackedLinear.forward` as configured, step budget 4096), and
with `--against DIR` `small-against`, the small GEMM of another checkout's kernels.

    python3 -m benchmarks.kernels.linear_routing --dtype bfloat16 --rows 700 1024 1295 2048
    python3 -m benchmarks.kernels.linear_routing --dtype float32 --rows 1100 1295 1600 2100 \\
        --threads 1
    python3 -m benchmarks.kernels.linear_routing --rows 1024 4096 --copies 4 --against /tmp/base
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.kernels.cpu_attention_kernel import load_other_kernels
from carpool import kernels as cpu_kernels
from carpool.platform.cpu_linear import MAX_ROWS, PackedLinear, this_cpu_route

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out), SmolLM2-135M


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--rows", type=int, nargs="+", default=[700, 1024, 1295, 2048])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--copies", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against", metavar="DIR",
                        help="another checkout whose small GEMM to time too (`small-against`)")
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    dtype = getattr(torch, ns.dtype)
    kernels = cpu_kernels.load()
    route = this_cpu_route(dtype, kernels, full_rows=4096)
    layers = [PackedLinear(nn.Linear(i, o, bias=False).to(dtype), kernels, route)
              for _ in range(ns.copies) for i, o in SHAPES]
    small_gemm = None if kernels is None else small_gemm_of(kernels, dtype)
    print(f"{len(layers)} {ns.dtype} layers, {ns.threads} threads, min of {ns.repeats}, ms a pass")
    sides = {"pieces": pieces, "padded": padded, "routed": lambda layer, x: layer(x)}
    if small_gemm is not None:
        sides["small"] = small_gemm
        if ns.against:
            sides["small-against"] = small_gemm_of(load_other_kernels(ns.against, None), dtype)
    for rows in ns.rows:
        xs = [torch.randn(rows, layer.in_features).to(dtype) for layer in layers]
        times = {name: [] for name in sides}
        with torch.inference_mode():
            for fn in sides.values():  # warm-up: oneDNN builds each shape's primitive once
                one_pass(fn, layers, xs)
            for _ in range(ns.repeats):
                for name, fn in sides.items():
                    begin = time.perf_counter()
                    one_pass(fn, layers, xs)
                    times[name].append(time.perf_counter() - begin)
        print(f"rows {rows:5} (padded to {-(-rows // MAX_ROWS) * MAX_ROWS}): "
              + "  ".join(f"{name} {1e3 * min(t):7.1f}" for name, t in times.items()))


def small_gemm_of(kernels, dtype: torch.dtype):
    """`kernels`' small GEMM of `dtype` as a (layer, x) -> y side (bfloat16 on AMX tiles), or
    None where it has none."""
    if dtype == torch.bfloat16 and kernels.has_amx():
        def small_gemm(layer, x):
            return kernels.small_gemm_bf16(x, layer.small.packed, layer.out_features, None, True)
    elif dtype == torch.float32 and kernels.has_f32_gemm():
        def small_gemm(layer, x):
            return kernels.small_gemm_f32(x, layer.small.packed, layer.out_features, None)
    else:
        small_gemm = None
    return small_gemm


def one_pass(fn, layers: list[PackedLinear], xs: list[torch.Tensor]) -> None:
    for layer, x in zip(layers, xs):
        fn(layer, x)


def pieces(layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([layer._matmul(x[s:s + MAX_ROWS]) for s in range(0, len(x), MAX_ROWS)])


def padded(layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    return layer.packed_matmul(F.pad(x, (0, 0, 0, -len(x) % MAX_ROWS)))

if __name__ == "__main__":
    main()
