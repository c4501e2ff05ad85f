"""Wall time of a decode step at N running requests, the sdpa backend's decode groups
8 against 1, alternated in one process; optionally cuDNN's SDPA on against off (CUDA),
and a torch.profiler table of 10 steps.

Why: on CUDA a decode step is bound by the host issuing launches, and each decode group
is a handful of launches per layer (BENCHMARKS.md §35). Runs on any device.

    python3 -m benchmarks.profile.decode_step_groups --model /tmp/vs-vllm/135m-bfloat16 \\
        --num-running 256 --device cuda --profile
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-running", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=4, help="alternating 8 and 1 groups")
    parser.add_argument("--compare-cudnn", action="store_true",
                        help="then, at the backend's own groups, alternate rounds with torch's "
                             "cuDNN SDPA allowed and not (torch.backends.cuda.enable_cudnn_sdp)")
    parser.add_argument("--profile", action="store_true",
                        help="then profile 10 steps with the backend's own setting")
    args = parser.parse_args()

    import torch

    from carpool.llm import LLM
    from carpool.sampling_params import SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=256,
              max_num_batched_tokens=4096, kv_cache_memory=8 * 2**30, seed=0,
              attention_backend="sdpa")
    engine = llm.engine
    attention = engine.runner.attention
    own = attention.max_decode_groups
    on_cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    budget = (1 + args.compare_cudnn) * args.rounds * (args.steps + 2) + 20
    params = SamplingParams(max_tokens=budget, min_tokens=budget, ignore_eos=True,
                            temperature=0.0)
    num_ids = min(engine.vocab_size, 1003) - 3  # ordinary ids: past the special tokens
    for i in range(args.num_running):
        engine.add_request(f"r{i}", [(7 * i + j) % num_ids + 3 for j in range(args.prompt_len)],
                           params)
    while True:  # every prompt prefilled
        engine.step()
        stats = engine.stats()
        if stats.num_waiting == 0 and stats.last_step_num_prefill_tokens == 0:
            break
    for _ in range(5):
        engine.step()
    def timed_round() -> float:
        engine.step()
        engine.step()
        sync()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        sync()
        return 1000 * (time.perf_counter() - start) / args.steps

    times: dict[int, list[float]] = {8: [], 1: []}
    for round_ in range(args.rounds):
        groups = (8, 1)[round_ % 2]
        attention.max_decode_groups = groups
        times[groups].append(timed_round())
    for groups, values in times.items():
        print(f"{args.num_running} running, {groups} decode group(s): "
              f"{' / '.join(f'{v:.2f}' for v in values)} ms per decode step")
    attention.max_decode_groups = own
    if args.compare_cudnn and on_cuda:
        allowed = torch.backends.cuda.cudnn_sdp_enabled()
        cudnn_times: dict[bool, list[float]] = {True: [], False: []}
        for round_ in range(args.rounds):
            enabled = round_ % 2 == 0
            torch.backends.cuda.enable_cudnn_sdp(enabled)
            cudnn_times[enabled].append(timed_round())
        torch.backends.cuda.enable_cudnn_sdp(allowed)
        for enabled, values in cudnn_times.items():
            print(f"{args.num_running} running, {own} decode group(s), cuDNN SDPA "
                  f"{'allowed' if enabled else 'off'}: "
                  f"{' / '.join(f'{v:.2f}' for v in values)} ms per decode step")
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if on_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(10):
                engine.step()
            sync()
        table = prof.key_averages()
        # By host time (kernel launch calls, with their counts), and on CUDA by kernel time.
        for key in ("self_cpu_time_total", "self_cuda_time_total")[:1 + on_cuda]:
            print(table.table(sort_by=key, row_limit=15, max_name_column_width=50))
    return 0


if __name__ == "__main__":
    sys.exit(main())
