"""The quantized GEMM (`quant_linear`) against the bfloat16 small GEMM and oneDNN's bfloat16
matmul, on a model's linear shapes.

Each variant gets its own copies of the model's four layer shapes (qkv, o, gate_up, down),
`--copies` times over so that their weights stream from memory as a whole model's do, with
the same random weight; one pass over all of them is timed at each row count, the variants
alternated pass by pass, best pass each (`--stat median`: the median). Variants (bfloat16 rows):
  bf16-small   `small_gemm_bf16` on the bfloat16 weight (`PackedLinear`'s packed copy)
  bf16-onednn  `PackedLinear._matmul` (oneDNN, bucketed rows)
  int8 / int4  `quant_linear` on `pack_quant_weight` (int8: g 32, no mins, as GGUF Q8_0;
               int4: g 32 with mins, as Q4_0 / AWQ)
  int8-dq / int4-dq  `dequantize_rows` to bfloat16, then `F.linear` (oneDNN): the prefill path
  int8-r / int4-r    `quant_linear` with `rounded_from=1`: the weight rounded to bfloat16 pairs
               once per call, summed over K in registers (bfloat16 rows, AVX512-BF16 only)
Prints each variant's time a pass, its speed over bf16-small's, and its weight bytes a pass.

    python3 -m benchmarks.kernels.quant_gemm --shapes 0.5B --copies 4 --rows 1 4 16 64 256 1024
    python3 -m benchmarks.kernels.quant_gemm --shapes 135M --copies 16 --rows 1 4 16 64 256 1024
    python3 -m benchmarks.kernels.quant_gemm --dtype float32 --variants int8 int4 int8-dq
    python3 -m benchmarks.kernels.quant_gemm --capability AVX2 --rows 1 16 32 64
    python3 -m benchmarks.kernels.quant_gemm --rows 1 2 --variants q5_0 q4_k q6_k \
        --baseline ~/.cache/torch_extensions/py311_cpu/<an older build>/<its name>.so

`--baseline` times the variants of another build of the kernels too (its own packing; all but
bf16-onednn), alternated with this one's as "<variant>@base": before / after in one run.
`--stat median` reports each variant's median pass instead of its best: a change to how the
threads split a call shows in the typical pass, which a quiet moment's best hides.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from carpool import kernels as cpu_kernels
from carpool.platform.cpu_linear import PackedLinear

# (in_features, out_features): qkv, o, gate_up, down
SHAPES = {
    "0.5B": [(896, 1152), (896, 896), (896, 9728), (4864, 896)],  # Qwen2.5-0.5B
    "135M": [(576, 960), (576, 576), (576, 3072), (1536, 576)],   # SmolLM2-135M
}
VARIANTS = ["bf16-small", "bf16-onednn", "int8", "int4", "int8-dq", "int4-dq", "int8-r",
            "int4-r", "q5_0", "q4_k", "q6_k"]
# GGUF's types as carpool packs them (carpool/platform/cpu_quant.py): (bits, group, mins,
# float16 header) of the canonical form (q6_k's int8 q packed in bits 6 where the build has
# them); the q and scales random, of the type's ranges
GGUF_TYPES = {"q5_0": (5, 32, False, True), "q4_k": (4, 32, True, False),
              "q6_k": (8, 16, False, False)}


def quantized(weight: torch.Tensor, bits: int, group: int, mins: bool):
    """A canonical quantized form of weight [N, K] (round to nearest; scales per group)."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group, group)
    if mins:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale = ((hi - lo) / (2 ** bits - 1)).clamp_min(1e-8)
        q = ((w - lo) / scale).round().clamp(0, 2 ** bits - 1)
        offset = lo.squeeze(-1)
    else:
        scale = (w.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)).clamp_min(1e-8)
        q = (w / scale).round().clamp(-2 ** (bits - 1), 2 ** (bits - 1) - 1)
        offset = None
    q = q.reshape(n, k)
    if bits == 8:
        qweight = q.to(torch.int8)
    else:
        units = q.to(torch.uint8).reshape(n, k // 32, 2, 16)
        qweight = (units[:, :, 0] | (units[:, :, 1] << 4)).reshape(n, k // 2)
    return qweight, scale.squeeze(-1), offset, bits, group


class Variant:
    def __init__(self, name: str, linear: nn.Linear, kernels) -> None:
        self.out_features = linear.out_features
        self.bytes = 0
        if name.startswith("bf16"):
            self.layer = PackedLinear(linear, kernels)
            self.bytes = linear.weight.numel() * 2
            if name == "bf16-small":
                packed = self.layer.small.packed
                self.run = lambda x: kernels.small_gemm_bf16(x, packed, self.out_features)
            else:
                self.run = self.layer._matmul
            return
        if name in GGUF_TYPES:
            bits, group, mins, f16 = GGUF_TYPES[name]
            qweight, scale, offset, _, _ = quantized(linear.weight, 8 if bits == 5 else bits,
                                                     group, mins)
            if bits == 5:
                qweight = qweight.clamp(-16, 15)
            elif bits == 8:
                qweight = qweight.clamp(-32, 31)
            if f16:
                scale = scale.half().float()
            try:  # Q6_K's q in bits 6 (its pairs one lookup); a build before them: bits 8
                packed = kernels.pack_quant_weight(qweight, scale, offset,
                                                   6 if name == "q6_k" else bits, group, f16)
            except RuntimeError:
                packed = kernels.pack_quant_weight(qweight, scale, offset, bits, group, f16)
            self.bytes = packed.nbytes
            self.run = lambda x: kernels.quant_linear(x, packed)
            return
        bits = 8 if name.startswith("int8") else 4
        packed = kernels.pack_quant_weight(*quantized(linear.weight, bits, 32, bits == 4))
        self.bytes = packed.nbytes
        if name.endswith("-r"):
            self.run = lambda x: kernels.quant_linear(x, packed, None, 1)
        elif name.endswith("-dq"):
            self.run = lambda x: F.linear(
                x, kernels.dequantize_rows(packed, 0, packed.n, x.dtype))
        else:
            self.run = lambda x: kernels.quant_linear(x, packed)


def import_module_file(path: Path):
    """An extension module from its file (its name is the file's stem, as torch builds it)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        sys.exit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="0.5B")
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    parser.add_argument("--capability", choices=("AVX512", "AVX2"),
                        help="time this build of the kernels (default: this CPU's)")
    parser.add_argument("--baseline", type=Path,
                        help="a built kernels module (.so) whose variants run too")
    parser.add_argument("--stat", choices=["best", "median"], default="best",
                        help="each variant's best pass, or its median")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kernels = cpu_kernels.load(capability=args.capability)
    if kernels is None or not kernels.has_small_gemm_bf16():
        sys.exit("no compiled kernels with a bfloat16 small GEMM on this machine")
    torch.manual_seed(0)
    shapes = SHAPES[args.shapes] * args.copies
    linears = [nn.Linear(k, n, bias=False, dtype=torch.bfloat16) for k, n in shapes]
    names = [v for v in args.variants if dtype == torch.bfloat16 or not v.startswith("bf16")]
    builds = {"": kernels}
    if args.baseline is not None:
        builds["@base"] = import_module_file(args.baseline)
    # Packed layer by layer, the builds in turn: copies packed later ran 2-6% faster than the
    # same code packed earlier, so packing one build's copies after the other's favoured it.
    variants: dict[str, list[Variant]] = {}
    for linear in linears:
        for name in names:
            for tag, build in builds.items():
                if not (tag and name == "bf16-onednn"):
                    variants.setdefault(f"{name}{tag}", []).append(Variant(name, linear, build))
    print(f"{args.shapes} x {args.copies}: {len(linears)} layers, {args.dtype} rows, "
          f"{args.threads} threads; weight MB a pass: " + ", ".join(
              f"{name} {sum(v.bytes for v in vs) / 1e6:.0f}" for name, vs in variants.items()))
    with torch.inference_mode():
        for rows in args.rows:
            inputs = [torch.randn(rows, k, dtype=dtype) for k, _ in shapes]
            repeats = max(2, args.repeats if rows <= 64 else args.repeats // 3)
            passes = {name: [] for name in variants}
            for _ in range(repeats + 1):
                for name, layers in variants.items():
                    start = time.perf_counter()
                    for layer, x in zip(layers, inputs):
                        layer.run(x)
                    passes[name].append(time.perf_counter() - start)
            pick = min if args.stat == "best" else statistics.median
            per_pass = {name: pick(times[1:]) for name, times in passes.items()}  # 1st: warm-up
            base = per_pass.get("bf16-small")
            print(f"rows {rows:5d}  " + "  ".join(
                f"{name} {t * 1e3:8.2f} ms" + (f" ({base / t:4.2f}x)" if base else "")
                + (f" {sum(v.bytes for v in variants[name]) / t / 1e9:4.1f} GB/s"
                   if rows == 1 else "")
                for name, t in per_pass.items()), flush=True)


if __name__ == "__main__":
    main()
