"""The compiled elementwise passes (`csrc/fused_ops.cpp`) on the 135M model's shapes.

Times one call of `silu_and_mul` (gate_up [rows, 2 x 1536]), `rms_norm` (x, residual
[rows, 576]) and `rotary_` (q [rows, 9, 64] and k [rows, 3, 64], views into one qkv
projection output) at each row count, in milliseconds, best of `--repeats` rounds.
`--against DIR` also builds the kernels of another checkout (e.g. `git archive <commit> |
tar -x -C DIR`) and times them in the same process, alternated round by round with this
checkout's, and checks that the two give the same bits; `--against eager` times the model's
eager modules (`RMSNorm`, `SiluAndMul`, `Rotary`) instead. `--activations` takes real gate_up
rows (a saved list of [N, 3072] tensors) instead of random ones for silu_and_mul. `rms_norm
(q heads)` normalises each head of the q view, as Qwen3's per-head norms do.

    OMP_NUM_THREADS=1 python3 -m benchmarks.kernels.fused_ops --rows 2048 64
    OMP_NUM_THREADS=1 python3 -m benchmarks.kernels.fused_ops --against /tmp/old --dtype float16
    OMP_NUM_THREADS=1 python3 -m benchmarks.kernels.fused_ops --against /tmp/old \\
        --attention-shape 4 2 16
    python3 -m benchmarks.kernels.fused_ops --against eager --dtype float32 --threads 2 --hidden 256
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

from benchmarks.kernels.cpu_attention_kernel import load_other_kernels
from carpool import kernels as cpu_kernels
from carpool.models.llama import RMSNorm, SiluAndMul
from carpool.models.rope import Rotary

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64  # SmolLM2-135M


class EagerOps:
    """The model's eager modules behind the kernels' call signatures (`--against eager`); one
    RMSNorm per weight, made on first use, so a call times the module alone."""

    def __init__(self) -> None:
        self.norms: dict[tuple[int, float], RMSNorm] = {}

    def rms_norm(self, x, residual, weight, eps):
        key = (weight.data_ptr(), eps)
        if key not in self.norms:
            self.norms[key] = RMSNorm(weight.shape[0], eps).to(weight.dtype)
            self.norms[key].weight = nn.Parameter(weight, requires_grad=False)
        out = self.norms[key](x, residual)
        return out if residual is not None else (out, None)

    def silu_and_mul(self, gate_up):
        return SiluAndMul()(gate_up)

    def rotary_(self, q, k, cos, sin):  # returns the rotated pair (the kernel's is in place)
        return Rotary()(q, k, cos, sin)


def make_calls(rows: int, dtype: torch.dtype, activations: list[torch.Tensor] | None,
               attention_shape: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM),
               hidden: int = HIDDEN):
    """name -> (call(kernels) -> output tensors): inputs made once, shared by every build;
    rotary_ and the q heads' norm on `attention_shape` (query heads, kv heads, head_dim), the
    rows' norms `hidden` wide."""
    heads, kv_heads, head_dim = attention_shape
    gen = torch.Generator().manual_seed(rows)
    if activations:
        gate_up = torch.cat(activations)[:rows].to(dtype).contiguous()
    else:
        gate_up = (torch.randn(rows, 2 * INTERMEDIATE, generator=gen) * 2).to(dtype)
    x = torch.randn(rows, hidden + 2, generator=gen).to(dtype)[:, :hidden]
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    head_weight = (torch.rand(head_dim, generator=gen) + 0.5).to(dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.arange(rows)[:, None] * 0.1 ** torch.linspace(0, 4, head_dim // 2)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype)

    def rotary(kernels):  # in place on a fresh copy each time, so every build sees one input
        q, k, _ = qkv.clone().split([heads * head_dim, kv_heads * head_dim,
                                     kv_heads * head_dim], dim=-1)
        q, k = q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim)
        rotated = kernels.rotary_(q, k, cos, sin)
        return (q, k) if rotated is None else rotated

    def q_heads(kernels):
        q = qkv[:, :heads * head_dim].view(rows, heads, head_dim)
        return kernels.rms_norm(q, None, head_weight, 1e-6)[:1]

    return {
        "silu_and_mul": lambda kernels: (kernels.silu_and_mul(gate_up),),
        "rms_norm": lambda kernels: kernels.rms_norm(x, residual, weight, 1e-5),
        "rms_norm (no residual)": lambda kernels: kernels.rms_norm(x, None, weight, 1e-5)[:1],
        "rms_norm (q heads)": q_heads,
        "rotary_ (+ qkv copy)": rotary,
        "qkv copy alone": lambda kernels: (qkv.clone(),),
    }


def seconds(call, kernels, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call(kernels)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2048, 64])
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--against", help="another checkout whose kernels to time alongside, "
                        "or eager: the model's eager modules")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="the rows' norms' width")
    parser.add_argument("--activations", help="a torch.save'd list of bf16 gate_up tensors")
    parser.add_argument("--attention-shape", type=int, nargs=3, default=[HEADS, KV_HEADS, HEAD_DIM],
                        metavar=("HEADS", "KV_HEADS", "HEAD_DIM"), help="rotary_'s q and k")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    builds = {"this": cpu_kernels.load()}
    if args.against == "eager":
        builds["against"] = EagerOps()
    elif args.against:
        builds["against"] = load_other_kernels(args.against)
    if any(k is None for k in builds.values()):
        sys.exit("the compiled kernels did not build")
    activations = torch.load(args.activations) if args.activations else None
    print(f"{args.dtype}, {args.threads} thread(s), ms per call, best of {args.repeats}")
    header = f"{'op':24s} {'rows':>5s} " + " ".join(f"{name:>9s}" for name in builds)
    print(header + ("   this/against  same bits" if args.against else ""))
    with torch.inference_mode():
        for rows in args.rows:
            for name, call in make_calls(rows, dtype, activations, tuple(args.attention_shape),
                                         args.hidden).items():
                calls = max(3, int(2e5 // rows))
                best = {b: float("inf") for b in builds}
                for _ in range(args.repeats):  # alternate the builds round by round
                    for b, kernels in builds.items():
                        call(kernels)
                        best[b] = min(best[b], seconds(call, kernels, calls))
                line = f"{name:24s} {rows:5d} " + " ".join(f"{best[b] * 1e3:9.4f}" for b in builds)
                if args.against:
                    same = all(torch.equal(a.view(torch.int16 if a.element_size() == 2 else
                                                  torch.int32),
                                           b.view(torch.int16 if b.element_size() == 2 else
                                                  torch.int32))
                               for a, b in zip(call(builds["this"]), call(builds["against"])))
                    line += f"   {best['this'] / best['against']:12.2f}  {same}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
