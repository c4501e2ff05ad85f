"""Median step time and its host part, static vs continuous, on a small batch of equal requests.

Where the model is a few hundred thousand parameters, a step's host work (scheduling,
batch and metadata building, output processing) is a large share of it, and a
scheduler's own cost shows. N requests of the same prompt and output length run to
the end under each scheduler (alternated, `--rounds` times, one thread); every step
is timed, and its host part is the step time outside the model forward, the logits
and the sampler (`profile_steps.KernelClock`). The first and last two steps (prefill,
drain) are left out of the medians.

    python3 -m benchmarks.make_checkpoint /tmp/llama-300k --hidden-size 64 \\
        --intermediate-size 256 --num-layers 3 --num-heads 4 --num-kv-heads 2 --vocab-size 1024
    python3 -m benchmarks.profile.step_host_cost /tmp/llama-300k --num-requests 8 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.profile.profile_steps import KernelClock


def run(model: str, num_requests: int, prompt_len: int, output_len: int, rounds: int) -> dict:
    """{scheduler: [(median step ms, median host ms) per round]}."""
    import torch

    from carpool.llm import LLM
    from carpool.sampling_params import SamplingParams

    torch.set_num_threads(1)
    clock = KernelClock()
    clock.install()
    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, ignore_eos=True,
                            temperature=0.0)
    results: dict[str, list[tuple[float, float]]] = {}
    for scheduler in ("static", "continuous") * rounds:
        engine = LLM(model=model, scheduler=scheduler, enable_chunked_prefill=False,
                     max_num_seqs=num_requests, max_model_len=prompt_len + output_len + 16,
                     seed=0).engine
        for i in range(num_requests):
            engine.add_request(f"r{i}", list(range(1, prompt_len + 1)), params)
        steps, hosts = [], []
        while engine.has_unfinished_requests():
            kernel_start, start = clock.seconds, time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
            steps.append(elapsed)
            hosts.append(elapsed - (clock.seconds - kernel_start))
        results.setdefault(scheduler, []).append(
            (1000 * statistics.median(steps[2:-2]), 1000 * statistics.median(hosts[2:-2])))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results = run(args.model, args.num_requests, args.prompt_len, args.output_len, args.rounds)
    for scheduler, rounds in results.items():
        print(f"{scheduler:10s} " + "; ".join(
            f"step {step:.3f} ms, host {host:.3f} ms ({host / step:.0%})" for step, host in rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
