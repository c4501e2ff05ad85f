"""The cpu attention backend with its C++ kernel vs its PyTorch paths, alternated in one run.

Every side attends the same step (built through `build_input_batch` from a
`SchedulerOutput`, metadata by the backend) over the 135M model's attention shape (9 query
heads, 3 KV heads, head_dim 64, block size 16; `--attention-shape` for another), with the
same thread count. One timed sample is `--layers` consecutive layer calls, each on its own
KV cache (so the caches do not all sit in the L3 cache, as in a real step); samples of the
sides alternate, in the reverse order every other sample (a fixed order alone moved two
builds of the same kernel by ~5%), and the table gives the medians and the ratios of
per-sample times.
Per-step work (the batch metadata and int32 tables) is built once, outside the timing, and
so is the step's KV write (the caches hold this step's k and v before any side attends, so
fresh prompts read the same keys on every side).

The kernel sides take every row, fresh prompts of any length included (the PyTorch side
runs the query-block matmuls for those). `--against DIR` adds a third side: the kernel
built from another checkout's `carpool/kernels/csrc` (or, before the kernels package,
`carpool/attention/csrc`; e.g. `git archive <commit>`
unpacked), called through this checkout's backend, and the share of output values in which
the two builds differ (0: the same bits).

    python3 -m benchmarks.kernels.cpu_attention_kernel
    python3 -m benchmarks.kernels.cpu_attention_kernel --repeats 31 --threads 2 \
        --against /tmp/attn-base
    python3 -m benchmarks.kernels.cpu_attention_kernel --attention-shape 4 2 16 \
        --cases decodes --dtypes bfloat16 --against /tmp/attn-base
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import time
from pathlib import Path

import torch

from carpool import kernels as cpu_kernels
from carpool.attention import AttentionShape, create_backend
from carpool.attention.base import write_kv
from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput
from carpool.runner.input_batch import build_input_batch
from carpool.sampling_params import SamplingParams

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def make_step(num_decodes: int, chunks: list[tuple[int, int]], seed: int,
              context: int | None = None, shared: int = 0):
    """A SchedulerOutput of decodes with contexts of 16-512 tokens (all `context` if given)
    and (prefix, chunk) chunks (prefix 0: a fresh prompt), with shuffled block ids; the
    chunks' first `shared` tokens (whole blocks) in the same blocks, as prompts sharing a
    cached prefix have them. Returns it and the number of cache blocks it needs."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(context - 1 if context else int(torch.randint(15, 512, (1,), generator=gen)), 1)
              for _ in range(num_decodes)]
    shapes += chunks
    blocks_needed = [-(-(prefix + new) // BLOCK_SIZE) for prefix, new in shapes]
    num_shared = shared // BLOCK_SIZE
    num_blocks = sum(blocks_needed) + 1
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shared_ids = [order.pop() for _ in range(num_shared)]
    scheduled = []
    for i, ((prefix, new), needed) in enumerate(zip(shapes, blocks_needed)):
        own = needed - num_shared if i >= num_decodes and num_shared else needed
        block_ids = (shared_ids if own < needed else []) + [order.pop() for _ in range(own)]
        scheduled.append(ScheduledRequest(
            request_id=str(i), token_ids=[1] * new, num_computed_tokens=prefix,
            block_ids=block_ids, sample=True, sampling_params=SamplingParams()))
    return SchedulerOutput(scheduled=scheduled), num_blocks


def load_other_kernels(tree: str, build_dir: str | None = None):
    """The kernels module built from another checkout's csrc (its own loader, so the build is
    named by that tree's sources and both modules load side by side): `carpool/kernels/
    loader.py` in a tree of today's layout, `carpool/attention/cpu_kernels.py` in an older one."""
    path = Path(tree) / "carpool" / "kernels" / "loader.py"
    if not path.exists():
        path = Path(tree) / "carpool" / "attention" / "cpu_kernels.py"
    spec = importlib.util.spec_from_file_location("other_cpu_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernels = module.load(build_dir)
    if kernels is None:
        raise SystemExit(f"the C++ kernels of {tree} could not be built")
    if not hasattr(kernels, "has_amx"):  # a tree from before the AMX paths
        return _WithoutAmx(kernels)
    return kernels


class _WithoutAmx:
    """An older kernels module as this checkout's backend calls it: no AMX prefill path."""

    def __init__(self, kernels) -> None:
        self._kernels = kernels

    def __getattr__(self, name):
        return getattr(self._kernels, name)

    @staticmethod
    def has_amx() -> bool:
        return False

    def prefill_attention_bf16(self, *args, amx: bool = False):
        return self._kernels.prefill_attention_bf16(*args)


def bench_case(kernel_modules: dict, name: str, dtype: torch.dtype, num_decodes: int,
               chunks: list[tuple[int, int]], num_layers: int, repeats: int,
               context: int | None = None, clock=time.perf_counter, shared: int = 0,
               attention_shape: tuple[int, int, int] = (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)) -> dict:
    """Median ms per layer call of each side ("torch" and one per kernels module), the
    medians of the per-sample ratios torch / side, each side's max abs diff to torch, and
    (with a "before" side) the share of output values where "before" and "kernel" differ;
    `attention_shape` is (query heads, kv heads, head_dim)."""
    num_heads, num_kv_heads, head_dim = attention_shape
    step, num_blocks = make_step(num_decodes, chunks, seed=num_decodes + len(chunks),
                                 context=context, shared=shared)
    batch = build_input_batch(step, block_size=BLOCK_SIZE, scratch_block=num_blocks - 1,
                              device=torch.device("cpu"))
    num_tokens = batch.layout.num_tokens
    caches = [torch.randn(2, num_kv_heads, num_blocks, BLOCK_SIZE, head_dim).to(dtype)
              for _ in range(num_layers)]
    q = torch.randn(num_tokens, num_heads, head_dim).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    # dtype: bfloat16 backends send prompt chunks to prefill_attention_bf16, as in the engine
    shape = AttentionShape(num_heads, num_kv_heads, head_dim, dtype=dtype)
    cpu = torch.device("cpu")
    backends = {"torch": create_backend("cpu", shape, cpu)}
    for side, module in kernel_modules.items():
        backends[side] = create_backend("cpu", shape, cpu, kernels=module)
    metas = {side: backend.build_metadata(batch.layout) for side, backend in backends.items()}
    for cache in caches:  # this step's KV write, once, outside the timing
        write_kv(cache, metas["torch"].slot_mapping, k, v)

    def run(side):
        for cache in caches:
            backends[side].attend(q, k, v, cache, metas[side], scale)

    expected = backends["torch"].attend(q, k, v, caches[0], metas["torch"], scale).float()
    outs = {side: backends[side].attend(q, k, v, caches[0], metas[side], scale).float()
            for side in kernel_modules}
    max_diff = {side: (out - expected).abs().max().item() for side, out in outs.items()}
    differ = ((outs["before"] != outs["kernel"]).float().mean().item()
              if "before" in outs else None)
    times = {side: [] for side in backends}
    order = list(backends)
    for sample in range(repeats):
        for side in order if sample % 2 == 0 else reversed(order):
            begin = clock()
            run(side)
            times[side].append((clock() - begin) / num_layers)
    speedup = {side: statistics.median(t / c for t, c in zip(times["torch"], times[side]))
               for side in kernel_modules}
    if "before" in kernel_modules:  # per-sample ratios of the two kernels
        speedup["before/kernel"] = statistics.median(
            b / c for b, c in zip(times["before"], times["kernel"]))
    return dict(name=name, dtype=str(dtype).removeprefix("torch."),
                ms={side: 1e3 * statistics.median(t) for side, t in times.items()},
                speedup=speedup, max_diff=max_diff, differ=differ)


def prefill_step_chunks(tokens: int = 4096, seed: int = 0) -> list[tuple[int, int]]:
    """Fresh prompts of 16-512 tokens (vs_vllm.py's lengths) filling one `tokens` step, as
    the engine's prefill phase schedules them (the last one cut to fit)."""
    gen = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(min(gen.randint(16, 512), tokens - sum(lens)))
    return [(0, n) for n in lens]


CASES = [  # (name, decodes, (prefix, new) chunks, decode context[, tokens the chunks share])
    ("40 decodes", 40, [], None),
    ("200 decodes", 200, [], None),
    ("4 chunks x64 on 256 + 36 decodes", 36, [(256, 64)] * 4, None),
    # The shared-prefix workload's decodes (section 8): long, equal contexts.
    ("16 decodes at 830 tokens", 16, [], 830),
    # The shared-prefix workload's first step (issue 15): one request computes the 800-token
    # prompt, 15 more share its first 768 tokens (its blocks) in that very step, 32 new each.
    ("800 fresh + 15 chunks x32 on 768", 0, [(0, 800)] + [(768, 32)] * 15, None, 768),
    # Fresh prompts (no cached tokens): the prefill phase.
    ("4 fresh prompts x256", 0, [(0, 256)] * 4, None),
    ("1 fresh prompt x512", 0, [(0, 512)], None),
    ("1 fresh prompt x1024", 0, [(0, 1024)], None),
    ("1 fresh prompt x2048", 0, [(0, 2048)], None),
    ("1 fresh prompt x4096", 0, [(0, 4096)], None),
    # vs_vllm.py's prefill phase: a full step of fresh prompts of 16-512 tokens
    ("prefill step: 4096 tok of 16-512", 0, prefill_step_chunks(), None),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6, help="layer caches per timed sample")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--build-dir", default=None)
    parser.add_argument("--against", metavar="DIR", default=None,
                        help="another checkout whose kernel is timed as the side 'before'")
    parser.add_argument("--cases", default=None,
                        help="comma-separated substrings: run only the cases naming one")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the process's CPU time (all threads; steadier on a shared "
                             "machine, with OMP_WAIT_POLICY=PASSIVE so idle threads sleep)")
    parser.add_argument("--attention-shape", type=int, nargs=3,
                        default=[NUM_HEADS, NUM_KV_HEADS, HEAD_DIM],
                        metavar=("HEADS", "KV_HEADS", "HEAD_DIM"))
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    started = time.perf_counter()
    modules = {}
    if ns.against:
        modules["before"] = load_other_kernels(ns.against, ns.build_dir)
    modules["kernel"] = cpu_kernels.load(ns.build_dir)
    if modules["kernel"] is None:
        raise SystemExit("the C++ kernels could not be built")
    clock = time.process_time if ns.clock == "cpu" else time.perf_counter
    print(f"kernel load {time.perf_counter() - started:.1f} s, threads {ns.threads}, "
          f"{ns.layers} layer caches per sample, {ns.repeats} alternated samples per side, "
          f"{ns.clock} clock")
    cases = [c for c in CASES if ns.cases is None
             or any(part in c[0] for part in ns.cases.split(","))]
    sides = ["torch", *modules]
    header = f"{'case':34} {'dtype':9}" + "".join(f" {s + ' ms':>10}" for s in sides)
    header += "".join(f" {'torch/' + s:>13}" for s in modules)
    if "before" in modules:
        header += f" {'before/kernel':>13}"
    header += "".join(f" {s + ' diff':>12}" for s in modules)
    print(header + (f" {'differ':>8}" if "before" in modules else ""))
    for dtype in (getattr(torch, d) for d in ns.dtypes.split(",")):
        for name, num_decodes, chunks, context, *shared in cases:
            row = bench_case(modules, name, dtype, num_decodes, chunks, ns.layers, ns.repeats,
                             context, clock, shared=shared[0] if shared else 0,
                             attention_shape=tuple(ns.attention_shape))
            line = f"{row['name']:34} {row['dtype']:9}"
            line += "".join(f" {row['ms'][s]:10.3f}" for s in sides)
            line += "".join(f" {row['speedup'][s]:12.2f}x" for s in modules)
            if "before" in modules:
                line += f" {row['speedup']['before/kernel']:12.2f}x"
            line += "".join(f" {row['max_diff'][s]:12.2e}" for s in modules)
            if row["differ"] is not None:
                line += f" {row['differ']:8.4%}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
