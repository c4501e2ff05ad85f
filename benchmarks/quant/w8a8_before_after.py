"""A W8A8 checkpoint served by carpool with its per-channel linears as int8 x int8 products
(`w8a8_linear`, now) against the path before them (rows rounded by `int8_per_token`, then the
int8 weight-only kernel up to 256 rows and oneDNN on a dequantized copy above), both engines
in one process, alternated round by round, the same threads: the engine-level before / after
of the kernel, without vLLM and at whatever load the machine has.

The "before" engine is loaded with `QuantizedWeight.int8_product` forced off, which is the
only switch between the two paths (`platform/cpu_quant.pack_part`). Workloads: a prefill
(`--prompts` prompts of `--prompt-len` tokens, one token out: the time to first tokens) and
a decode (as many prompts of 16 tokens, `--decode-tokens` out, ignore_eos).

    python3 -m benchmarks.quant.w8a8_before_after /work/vs-vllm/135m-w8a8 --threads 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from unittest import mock

import torch

from carpool import LLM, SamplingParams
from carpool.models.quant.weight import QuantizedWeight


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = dict(dtype="bfloat16", num_kv_blocks=2048, max_num_batched_tokens=2048)
    with mock.patch.object(QuantizedWeight, "int8_product", property(lambda self: False)):
        before = LLM(args.model, **settings)
    after = LLM(args.model, **settings)
    rng = random.Random(0)
    long = [[rng.randrange(3, 40000) for _ in range(args.prompt_len)]
            for _ in range(args.prompts)]
    short = [p[:16] for p in long]
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, llm in (("before", before), ("after", after)):
            times.setdefault(f"prefill {name}", []).append(timed(llm, long, 1))
            times.setdefault(f"decode {name}", []).append(timed(llm, short, args.decode_tokens))
    for phase in ("prefill", "decode"):
        b = statistics.median(times[f"{phase} before"])
        a = statistics.median(times[f"{phase} after"])
        print(f"{phase:8} before {b * 1e3:9.1f} ms  after {a * 1e3:9.1f} ms  {b / a:5.2f}x "
              f"(medians of {args.rounds})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
