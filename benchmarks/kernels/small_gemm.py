"""The compiled few-row GEMMs against oneDNN's packed matmul, on a model's linear shapes.

Builds `PackedLinear`s of the 135M model's four layer shapes (SmolLM2-135M: qkv, o,
gate_up, down), `--copies` times over so that their weights stream from memory as a
30-layer model's do (1 copy: they stay in cache, as a tiny model's do), and times one pass
over all of them at each row count, through oneDNN (`PackedLinear._matmul`, bucketed rows)
and through `small_gemm_f32` (`--dtype bfloat16`: `small_gemm_bf16`), alternated in one
process. Prints both times, their ratio, the small GEMM's GFLOP/s (against this CPU's
peak, `bf16_peak.py`) and the largest difference between the two results. `--against DIR`
also times the small GEMM of another checkout (e.g. `git archive <commit> | tar -x -C DIR`),
alternated pass by pass with this one's, and checks that the two give the same bits.

    python3 -m benchmarks.kernels.small_gemm --threads 2 --copies 30 --rows 1 2 4 8 12 16
    python3 -m benchmarks.kernels.small_gemm --threads 1 --copies 30 --rows 1 4 8 16 32 48
    python3 -m benchmarks.kernels.small_gemm --shapes tiny --copies 1
    python3 -m benchmarks.kernels.small_gemm --dtype bfloat16 --rows 1 4 16 64 128 256
    python3 -m benchmarks.kernels.small_gemm --dtype bfloat16 --amx --rows 3 16 64 128 256 512
    python3 -m benchmarks.kernels.small_gemm --dtype bfloat16 --rows 8 100 200 --against /tmp/base
    python3 -m benchmarks.kernels.small_gemm --shapes 135M-head --copies 4 --dtype bfloat16 --amx \
        --rows 16 64 100 200 --against /tmp/base
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

from benchmarks.kernels.cpu_attention_kernel import load_other_kernels
from carpool import kernels as cpu_kernels
from carpool.platform.cpu_linear import PackedLinear

SHAPES = {
    "135M": [(576, 960), (576, 576), (576, 3072), (1536, 576)],
    "135M-head": [(576, 49152)],  # its LM head alone: an output of 98 KB a row
    "tiny": [(256, 512), (256, 256), (256, 1376), (688, 256), (256, 4096)],  # the built-in model
    # vs_vllm.py's tiny model and §18's 0.3M model, LM head last
    "vs-tiny": [(256, 512), (256, 256), (256, 1536), (768, 256), (256, 4096)],
    "0.3M": [(64, 128), (64, 64), (64, 512), (256, 64), (64, 1024)],
}


def one_pass(layers: list[PackedLinear], inputs: list[torch.Tensor], small: bool, kernels,
             amx: bool = False) -> None:
    for layer, x in zip(layers, inputs):
        if small:
            small_gemm(kernels, x, amx)(x, layer.small.packed, layer.out_features, None)
        else:
            layer._matmul(x)


def small_gemm(kernels, x: torch.Tensor, amx: bool = False):
    if x.dtype != torch.bfloat16:
        return kernels.small_gemm_f32
    if amx:
        return lambda *args: kernels.small_gemm_bf16(*args, amx=True)
    return kernels.small_gemm_bf16


def seconds(layers, inputs, small: bool, kernels, repeats: int, amx: bool = False) -> float:
    for _ in range(2):
        one_pass(layers, inputs, small, kernels, amx)
    start = time.perf_counter()
    for _ in range(repeats):
        one_pass(layers, inputs, small, kernels, amx)
    return (time.perf_counter() - start) / repeats


def alternated_seconds(layers, inputs, builds: dict, repeats: int, amx: bool) -> dict[str, float]:
    """Best pass time of each build's small GEMM, the builds alternated pass by pass."""
    best = {name: float("inf") for name in builds}
    for kernels in builds.values():
        one_pass(layers, inputs, True, kernels, amx)
    for _ in range(repeats):
        for name, kernels in builds.items():
            start = time.perf_counter()
            one_pass(layers, inputs, True, kernels, amx)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def outputs(layers, inputs, kernels, amx: bool) -> list[torch.Tensor]:
    return [small_gemm(kernels, x, amx)(x, layer.small.packed, layer.out_features, None)
            for layer, x in zip(layers, inputs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="135M")
    parser.add_argument("--copies", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--amx", action="store_true",
                        help="bfloat16: the small GEMM on AMX tiles (small_gemm_bf16(amx=True))")
    parser.add_argument("--against", metavar="DIR",
                        help="another checkout whose small GEMM to time alongside this one's")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kernels = cpu_kernels.load()
    has_gemm = kernels is not None and (kernels.has_small_gemm_bf16() if dtype == torch.bfloat16
                                        else kernels.has_f32_gemm())
    if not has_gemm:
        sys.exit(f"no compiled kernels with a small {args.dtype} GEMM on this machine")
    if args.amx and not (dtype == torch.bfloat16 and kernels.has_amx()):
        sys.exit("--amx: bfloat16 only, on a CPU with AMX")
    torch.manual_seed(0)
    shapes = SHAPES[args.shapes] * args.copies
    layers = [PackedLinear(nn.Linear(k, n, bias=False, dtype=dtype), kernels)
              for k, n in shapes]
    print(f"{len(layers)} {args.dtype} layers, {args.threads} threads, "
          f"AMX {torch.cpu._is_amx_tile_supported()}")
    flops_per_row = 2 * sum(k * n for k, n in shapes)
    with torch.inference_mode():
        if args.against:
            builds = {"this": kernels, "against": load_other_kernels(args.against, None)}
            for rows in args.rows:
                inputs = [torch.randn(rows, k, dtype=dtype) for k, _ in shapes]
                best = alternated_seconds(layers, inputs, builds, args.repeats, args.amx)
                same = all(torch.equal(a, b) for a, b in zip(
                    *(outputs(layers, inputs, k, args.amx) for k in builds.values())))
                print(f"rows {rows:4d}  " + "  ".join(
                    f"{name} {t * 1e6:9.1f} us {rows * flops_per_row / t / 1e9:5.0f} GFLOP/s"
                    for name, t in best.items())
                    + f"  this/against {best['this'] / best['against']:.3f}  same bits {same}",
                    flush=True)
            return
        for rows in args.rows:
            inputs = [torch.randn(rows, k, dtype=dtype) for k, _ in shapes]
            onednn = seconds(layers, inputs, False, kernels, args.repeats)
            small = seconds(layers, inputs, True, kernels, args.repeats, args.amx)
            diff = max((small_gemm(kernels, x, args.amx)(x, layer.small.packed,
                                                         layer.out_features, None)
                        - layer._matmul(x)).abs().max().item()
                       for layer, x in zip(layers, inputs))
            print(f"rows {rows:4d}  oneDNN {onednn * 1e6:9.1f} us  small {small * 1e6:9.1f} us  "
                  f"small/oneDNN {small / onednn:.2f}  small "
                  f"{rows * flops_per_row / small / 1e9:5.0f} GFLOP/s  max diff {diff:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
