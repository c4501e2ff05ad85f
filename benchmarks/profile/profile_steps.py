"""Where carpool's time goes on the issue-8 workload: step times per phase and a torch profile.

Runs `vs_vllm.py`'s workload (N requests added at once) through the same engine
setup as its carpool worker, in this process, and splits the run into the
prefill phase (until every request has its first token) and the decode phase
(only decodes left). Prints the wall time of each phase, the median decode
step, and torch.profiler's table of the profiled phase by self CPU time, whose
total is the steadier figure on a noisy machine (compare it across commits).

    python3 -m benchmarks.profile.profile_steps /tmp/vs-vllm/135m-bfloat16 --dtype bfloat16 \\
        --phase decode
    python3 -m benchmarks.profile.profile_steps /tmp/vs-vllm/tiny-float32 --num-requests 200 \\
        --phase none

It also prints each phase's *host share*: the part of its step time spent outside
the model's forward, the logits and the sampler (scheduling, block accounting,
batch and attention-metadata building, output processing, detokenization), timed
by wrapping those three calls (exact with --threads 1: every op runs in line).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchmarks.compare.vs_vllm import build_requests
from benchmarks.compare.vs_vllm_common import WARMUP_PROMPT, Job
from benchmarks.compare.vs_vllm_worker_carpool import build

PHASES = ("prefill", "decode", "none")


class GcClock:
    """Seconds the cyclic garbage collector has paused this process (`gc.callbacks`)."""

    def __init__(self) -> None:
        import gc

        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


class KernelClock:
    """Seconds spent inside the model forward, the logits and the sampler, by wrapping them."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def install(self) -> None:
        from carpool.models.llama import LlamaForCausalLM
        from carpool.runner.sampler import Sampler

        for owner, name in ((LlamaForCausalLM, "forward"), (LlamaForCausalLM, "compute_logits"),
                            (Sampler, "sample")):
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def run(model: str, dtype: str, num_requests: int, phase: str, num_threads: int = 2,
        rows: int = 15, seed: int = 0, kv_cache_gib: int = 4) -> dict:
    """One run of the workload; returns phase timings (and prints the profile of `phase`)."""
    import torch

    clock, gc_clock = KernelClock(), GcClock()
    clock.install()
    job = Job("carpool", model, dtype, num_threads, {}, kv_cache_gib=kv_cache_gib)
    add, step = build(job)
    add(-1, WARMUP_PROMPT, 4)
    while not any(delta.finished for delta in step()):
        pass
    from carpool.models.config import load_model_config

    requests = build_requests(num_requests, load_model_config(Path(model)).vocab_size, seed)
    waiting_first = set(range(num_requests))
    num_left, times = num_requests, {"prefill": [], "decode": []}
    kernel_s = {"prefill": 0.0, "decode": 0.0}
    gc_s = {"prefill": 0.0, "decode": 0.0}
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    started = time.perf_counter()
    for index, (ids, num_output_tokens) in enumerate(requests):
        add(index, ids, num_output_tokens)
    profiling = False
    while num_left:
        current = "prefill" if waiting_first else "decode"
        if profiling != (current == phase):  # the profiled phase starts or ends here
            profiler.start() if not profiling else profiler.stop()
            profiling = not profiling
        kernel_start, gc_start, step_start = clock.seconds, gc_clock.seconds, time.perf_counter()
        deltas = list(step())
        times[current].append(time.perf_counter() - step_start)
        kernel_s[current] += clock.seconds - kernel_start
        gc_s[current] += gc_clock.seconds - gc_start
        for delta in deltas:
            if delta.new_token_ids:
                waiting_first.discard(delta.request_index)
            num_left -= delta.finished
    if profiling:
        profiler.stop()
    duration = time.perf_counter() - started
    num_tokens = sum(n for _, n in requests)
    result = {"duration_s": duration, "output_tok_s": num_tokens / duration,
              "prefill_s": sum(times["prefill"]), "num_prefill_steps": len(times["prefill"]),
              "decode_s": sum(times["decode"]), "num_decode_steps": len(times["decode"]),
              "decode_step_p50_ms": 1000 * statistics.median(times["decode"] or [0.0])}
    for name in ("prefill", "decode"):
        total = sum(times[name])
        result[f"{name}_host_share"] = 1 - kernel_s[name] / total if total else 0.0
        result[f"{name}_gc_share"] = gc_s[name] / total if total else 0.0
    print(f"{num_requests} requests, {num_tokens} output tokens in {duration:.1f} s "
          f"({result['output_tok_s']:.1f} tok/s); prefill phase {result['prefill_s']:.1f} s "
          f"over {result['num_prefill_steps']} steps; decode phase {result['decode_s']:.1f} s "
          f"over {result['num_decode_steps']} steps, median {result['decode_step_p50_ms']:.1f} ms")
    print(f"host share of the step (outside forward + logits + sampler): prefill phase "
          f"{result['prefill_host_share']:.1%}, decode phase {result['decode_host_share']:.1%}; "
          f"of it garbage collection: {result['prefill_gc_share']:.1%}, "
          f"{result['decode_gc_share']:.1%}")
    if phase != "none":
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="checkpoint folder (make_vs_vllm_checkpoints.py builds them)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--phase", choices=PHASES, default="decode", help="the phase to profile")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=15, help="profiler table rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    args = parser.parse_args()
    run(args.model, args.dtype, args.num_requests, args.phase, args.threads, args.rows, args.seed,
        args.kv_cache_gib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
