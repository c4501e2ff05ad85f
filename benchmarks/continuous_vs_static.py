"""Output tokens/s of continuous batching vs the static baseline, as a ratio from one run.

200 requests with token-id prompts of 16-512 tokens (uniform); half the outputs
are 16-32 tokens, half 128-256, all with ignore_eos so both schedulers produce
exactly the same tokens. One small random Llama (hidden 256, 4 layers, vocab
4096) is built in a temp folder; both variants run on it in the same process,
after one warm-up each, alternating order over rounds.

Static batching seats up to max_num_seqs requests, pads their prompts to the
longest, and keeps every seat until the batch's longest output ends; continuous
batching refills a seat the step after it frees. The ratio is the point; the
absolute figures depend on the machine (CPU time is printed beside wall time,
as a shared machine inflates wall time).

    python benchmarks/continuous_vs_static.py                  # a few minutes on 2 CPU cores
    python benchmarks/continuous_vs_static.py --profile        # + cProfile of one continuous run
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from carpool import LLM, SamplingParams  # noqa: E402
from carpool.testing.checkpoints import build_checkpoint  # noqa: E402

MODEL_SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2)
VOCAB_SIZE = 4096


def build_requests(num_requests: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length): prompts uniform 16-512, outputs half 16-32, half 128-256."""
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(16, 512))]
        num_output = rng.randint(16, 32) if i % 2 == 0 else rng.randint(128, 256)
        requests.append((prompt, num_output))
    rng.shuffle(requests)
    return requests


def run_variant(llm: LLM, requests, profile: cProfile.Profile | None = None) -> dict:
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    steps_before = llm.stats().num_steps
    wall, cpu = time.perf_counter(), time.process_time()
    if profile is not None:
        profile.enable()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if profile is not None:
        profile.disable()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_output == sum(n for _, n in requests), "ignore_eos: every output is full length"
    return dict(wall_s=wall, cpu_s=cpu, num_output_tokens=num_output,
                num_steps=llm.stats().num_steps - steps_before)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=1, help="Alternate the two variants this often.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine more threads spin "
                             "against other jobs and every small matmul slows; 0: torch's default).")
    parser.add_argument("--profile", action="store_true", help="cProfile one continuous run.")
    args = parser.parse_args()
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)

    folder = build_checkpoint(tempfile.mkdtemp(prefix="carpool-bench-"), "llama", seed=args.seed,
                              vocab_size=VOCAB_SIZE, **MODEL_SHAPE)
    requests = build_requests(args.num_requests, args.seed)
    common = dict(dtype="float32", max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=1024,
                  num_kv_blocks=args.max_num_seqs * (512 + 256) // 16 + 64, seed=args.seed)
    llms = {name: LLM(str(folder), scheduler=name, **common) for name in ("continuous", "static")}
    warmup = build_requests(8, args.seed + 1)
    for llm in llms.values():
        run_variant(llm, [(ids, 8) for ids, _ in warmup])

    print(f"{args.num_requests} requests, prompts 16-512 tokens, outputs 16-32 | 128-256 "
          f"(ignore_eos); max_num_seqs={args.max_num_seqs}, max_num_batched_tokens="
          f"{args.max_num_batched_tokens}; torch threads {torch.get_num_threads()}")
    profile = cProfile.Profile() if args.profile else None
    results: dict[str, list[dict]] = {"continuous": [], "static": []}
    for r in range(args.rounds):
        order = ("static", "continuous") if r % 2 == 0 else ("continuous", "static")
        for name in order:
            use_profile = profile if (name == "continuous" and r == 0) else None
            result = run_variant(llms[name], requests, use_profile)
            results[name].append(result)
            print(f"round {r} {name:>10}: {result['num_output_tokens']} output tokens in "
                  f"{result['num_steps']} steps, {result['wall_s']:.1f} s wall "
                  f"({result['num_output_tokens'] / result['wall_s']:.0f} tok/s), "
                  f"{result['cpu_s']:.1f} s CPU "
                  f"({result['num_output_tokens'] / result['cpu_s']:.0f} tok/s)", flush=True)
    for r in range(args.rounds):
        cont, static = results["continuous"][r], results["static"][r]
        print(f"round {r}: continuous / static output tokens/s = "
              f"{static['wall_s'] / cont['wall_s']:.2f}x wall, "
              f"{static['cpu_s'] / cont['cpu_s']:.2f}x CPU")
    if profile is not None:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(15)
        print("\ncProfile of one continuous run (top 15 by own time):")
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
