"""W8A8's per-token activation rounding: the eager `int8_per_token` (six PyTorch passes)
against the compiled `int8_per_token` kernel, alternated in one process, best of two rounds.

    python3 -m benchmarks.kernels.int8_per_token --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from carpool import kernels as cpu_kernels
from carpool.models.quant.weight import int8_per_token

SHAPES = ((1, 576), (1, 1536), (512, 576), (4096, 576))


def per_call_us(fn, x: torch.Tensor) -> float:
    calls = max(20, 20000 // x.shape[0])
    fn(x)
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("the C++ kernels could not be built here")
    for dtype in (torch.bfloat16, torch.float32):
        for rows, k in SHAPES:
            x = torch.randn(rows, k).to(dtype)
            best = {"eager": float("inf"), "kernel": float("inf")}
            for name, fn in (("eager", int8_per_token), ("kernel", kernels.int8_per_token)) * 2:
                best[name] = min(best[name], per_call_us(fn, x))
            print(f"{str(dtype).removeprefix('torch.'):9} [{rows:5}, {k}] eager "
                  f"{best['eager']:9.1f} us  kernel {best['kernel']:8.1f} us  "
                  f"{best['eager'] / best['kernel']:5.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
