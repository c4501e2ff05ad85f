"""W8A8 linears (int8 per-channel weights, inputs rounded per token): the int8 x int8 product
(`w8a8_linear`, VNNI on AVX-512 VNNI CPUs) against the path W8A8 took before it, alternated
in one process, best of `--rounds`:
  before  `int8_per_token` then `quant_matmul` on the int8 weight packed per channel (the
          register kernel up to the route's cut, 256 rows, on the weight rounded to bfloat16
          pairs from 16 bfloat16 rows on; above the cut `dequantize_rows` into oneDNN)
  after   `w8a8_linear` on `pack_w8a8_weight` (one call at every row count)
Prints microseconds a call and before / after.

    python3 -m benchmarks.kernels.w8a8_gemm --threads 2
    python3 -m benchmarks.kernels.w8a8_gemm --shape 576 1536 --rows 1 16 64 256 1024 --threads 2
    python3 -m benchmarks.kernels.w8a8_gemm --capability AVX2 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from carpool import kernels as cpu_kernels
from carpool.kernels.quant_rows import quant_matmul

CUT, ROUNDED_FROM = 256, 16  # cpu_route's int8 cut and bfloat16 rounded-pairs start (Zen 4)


def per_call_us(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=2, default=(576, 1536),
                        metavar=("K", "N"), help="in_features, out_features")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--capability", default=None, help="a narrower build, e.g. AVX2")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels.load(capability=args.capability)
    if kernels is None:
        raise SystemExit("the C++ kernels could not be built here")
    dtype = getattr(torch, args.dtype)
    k, n = args.shape
    gen = torch.Generator().manual_seed(0)
    qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, 1, generator=gen) / 256
    old = kernels.pack_quant_weight(qweight, scales, None, 8, k)
    new = kernels.pack_w8a8_weight(qweight, scales)
    rounded = ROUNDED_FROM if dtype == torch.bfloat16 else 0
    print(f"[rows, {k}] x [{k}, {n}], {args.dtype}, {args.threads} threads, "
          f"build {args.capability or 'native'}")
    for rows in args.rows:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        calls = max(5, 4000 // rows)
        arms = {
            "before": lambda x=x: quant_matmul(kernels, kernels.int8_per_token(x), old, None,
                                               CUT, rounded),
            "after": lambda x=x: kernels.w8a8_linear(x, new),
        }
        best = dict.fromkeys(arms, float("inf"))
        for _ in range(args.rounds):
            for name, fn in arms.items():
                best[name] = min(best[name], per_call_us(fn, calls))
        print(f"rows {rows:5}: before {best['before']:10.1f} us  after {best['after']:10.1f} us"
              f"  {best['before'] / best['after']:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
