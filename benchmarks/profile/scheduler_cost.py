"""The schedulers alone on §18's short/long mix: CPU time of `schedule()` + `update()`.

Builds `carpool bench offline --workload mix`'s 64 requests (the model directory gives the
tokenizer the workload is drawn with; no model runs), feeds them to the continuous scheduler
(prefix caching on and off) and to the static one with §18's settings (8 seats, the KV pool
the runner would size for them, chunked prefill off), and plays every step with a fixed
sampled token, until all requests end. Prints each variant's best of `--rounds` on the
thread's CPU clock, in total and a step. Inside the engine the same code runs colder (its
caches are the model's between steps), so `step_phases.py` reads its schedule phase higher.

    python3 -m benchmarks.profile.scheduler_cost /tmp/hostwork/llama-300k --rounds 7
"""

from __future__ import annotations

import argparse
import sys
import time

from carpool.bench.workloads import WorkloadConfig, build_workload
from carpool.core.config import SchedulerConfig
from carpool.core.request import Request
from carpool.core.scheduler import Scheduler
from carpool.core.static_scheduler import StaticScheduler
from carpool.engine.tokenizer import load_tokenizer
from carpool.sampling_params import SamplingParams

MAX_NUM_SEQS, BLOCK_SIZE = 8, 16
VARIANTS = (("continuous", True), ("continuous", False), ("static", False))


def play(requests, kind: str, prefix_caching: bool) -> tuple[float, int]:
    """(CPU seconds, steps) of one run of the requests through a fresh scheduler."""
    max_model_len = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    config = SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_model_len=max_model_len,
                             max_num_batched_tokens=max(2048, max_model_len),
                             enable_chunked_prefill=False, block_size=BLOCK_SIZE,
                             enable_prefix_caching=prefix_caching, scheduler=kind)
    num_blocks = MAX_NUM_SEQS * -(-max_model_len // BLOCK_SIZE)  # the runner's CPU default cap
    scheduler = (Scheduler if kind == "continuous" else StaticScheduler)(config, num_blocks)
    for i, request in enumerate(requests):
        scheduler.add_request(Request(f"bench-{i}", list(request.prompt_token_ids),
                                      SamplingParams(max_tokens=request.max_tokens,
                                                     temperature=0.0, ignore_eos=True)))
    num_steps = 0
    start = time.thread_time()
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update(out, {s.request_id: 7 for s in out.scheduled if s.sample})
        num_steps += 1
    return time.thread_time() - start, num_steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model directory (only its tokenizer is read)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    workload = WorkloadConfig(name="mix", num_prompts=64, input_len=64, short_output_len=8,
                              long_output_len=128)
    requests = build_workload(workload, load_tokenizer(args.model))
    best: dict[tuple[str, bool], tuple[float, int]] = {}
    for _ in range(args.rounds):  # variants interleaved, so a slow phase of the host is shared
        for variant in VARIANTS:
            best[variant] = min(best.get(variant, (float("inf"), 0)), play(requests, *variant))
    for (kind, caching), (seconds, steps) in best.items():
        print(f"{kind:10s} prefix caching {'on ' if caching else 'off'}  {seconds * 1e3:7.2f} ms"
              f"  {steps:5d} steps  {seconds / steps * 1e6:6.1f} µs a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
