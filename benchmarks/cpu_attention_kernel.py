"""The cpu attention backend with its C++ kernel vs its PyTorch paths, alternated in one run.

Both sides attend the same step (built through `build_input_batch` from a `SchedulerOutput`,
metadata by the backend) over the 135M model's attention shape (9 query heads, 3 KV heads,
head_dim 64, block size 16), with the same thread count. One timed sample is `--layers`
consecutive layer calls, each on its own KV cache (so the caches do not all sit in the L3
cache, as in a real step); samples of the two sides alternate, and the table gives the
medians and their ratio. Per-step work (the batch metadata and int32 tables) is built
once, outside the timing, for both sides.

    PYTHONPATH=$PWD python3 benchmarks/cpu_attention_kernel.py
    PYTHONPATH=$PWD python3 benchmarks/cpu_attention_kernel.py --repeats 31 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from carpool.attention import AttentionShape, cpu_kernels, create_backend
from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput
from carpool.runner.input_batch import build_input_batch
from carpool.sampling_params import SamplingParams

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def make_step(num_decodes: int, chunks: list[tuple[int, int]], seed: int,
              context: int | None = None):
    """A SchedulerOutput of decodes with contexts of 16-512 tokens (all `context` if given)
    and (prefix, chunk) chunks, with shuffled block ids; returns it and the number of cache
    blocks it needs."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(context - 1 if context else int(torch.randint(15, 512, (1,), generator=gen)), 1)
              for _ in range(num_decodes)]
    shapes += chunks
    blocks_needed = [-(-(prefix + new) // BLOCK_SIZE) for prefix, new in shapes]
    num_blocks = sum(blocks_needed) + 1
    order = torch.randperm(num_blocks, generator=gen).tolist()
    scheduled = []
    for i, ((prefix, new), needed) in enumerate(zip(shapes, blocks_needed)):
        block_ids = [order.pop() for _ in range(needed)]
        scheduled.append(ScheduledRequest(
            request_id=str(i), token_ids=[1] * new, num_computed_tokens=prefix,
            block_ids=block_ids, sample=True, sampling_params=SamplingParams()))
    return SchedulerOutput(scheduled=scheduled), num_blocks


def bench_case(kernels, name: str, dtype: torch.dtype, num_decodes: int,
               chunks: list[tuple[int, int]], num_layers: int, repeats: int,
               context: int | None = None) -> dict:
    step, num_blocks = make_step(num_decodes, chunks, seed=num_decodes, context=context)
    batch = build_input_batch(step, block_size=BLOCK_SIZE, scratch_block=num_blocks - 1,
                              device=torch.device("cpu"))
    num_tokens = batch.layout.num_tokens
    caches = [torch.randn(2, NUM_KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM).to(dtype)
              for _ in range(num_layers)]
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM).to(dtype)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    scale = HEAD_DIM ** -0.5
    shape, cpu = AttentionShape(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM), torch.device("cpu")
    pytorch = create_backend("cpu", shape, cpu)
    kernel = create_backend("cpu", shape, cpu, kernels=kernels)
    torch_meta = pytorch.build_metadata(batch.layout)
    kernel_meta = kernel.build_metadata(batch.layout)

    def torch_path():
        for cache in caches:
            pytorch.attend(q, k, k, cache, torch_meta, scale)

    def kernel_path():
        for cache in caches:
            kernel.attend(q, k, k, cache, kernel_meta, scale)

    expected = pytorch.attend(q, k, k, caches[0], torch_meta, scale)
    out = kernel.attend(q, k, k, caches[0], kernel_meta, scale)
    max_diff = (out.float() - expected.float()).abs().max().item()
    times = {"torch": [], "kernel": []}
    for _ in range(repeats):
        for side, run in (("torch", torch_path), ("kernel", kernel_path)):
            begin = time.perf_counter()
            run()
            times[side].append((time.perf_counter() - begin) / num_layers)
    ratios = [t / c for t, c in zip(times["torch"], times["kernel"])]
    return dict(name=name, dtype=str(dtype).removeprefix("torch."),
                torch_ms=1e3 * statistics.median(times["torch"]),
                kernel_ms=1e3 * statistics.median(times["kernel"]),
                speedup=statistics.median(ratios), max_diff=max_diff)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6, help="layer caches per timed sample")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--build-dir", default=None)
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    started = time.perf_counter()
    kernels = cpu_kernels.load(ns.build_dir)
    if kernels is None:
        raise SystemExit("the C++ kernels could not be built")
    print(f"kernel load {time.perf_counter() - started:.1f} s, threads {ns.threads}, "
          f"{ns.layers} layer caches per sample, {ns.repeats} alternated samples per side")
    cases = [(f"{n} decodes", n, [], None) for n in (40, 200)]
    cases.append(("4 chunks x64 on 256 + 36 decodes", 36, [(256, 64)] * 4, None))
    # The shared-prefix workload's decodes (section 8): long, equal contexts.
    cases.append(("16 decodes at 830 tokens", 16, [], 830))
    print(f"{'case':34} {'dtype':9} {'torch ms':>9} {'kernel ms':>10} {'speedup':>8} "
          f"{'max diff':>9}")
    for dtype in (torch.bfloat16, torch.float32):
        for name, num_decodes, chunks, context in cases:
            row = bench_case(kernels, name, dtype, num_decodes, chunks, ns.layers, ns.repeats,
                             context)
            print(f"{row['name']:34} {row['dtype']:9} {row['torch_ms']:9.3f} "
                  f"{row['kernel_ms']:10.3f} {row['speedup']:7.2f}x {row['max_diff']:9.2e}")


if __name__ == "__main__":
    main()
