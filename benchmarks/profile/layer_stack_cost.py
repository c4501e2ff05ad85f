"""A decode step with the decoder layers in one C++ call (`platform/cpu_layer_stack.py`)
against the same step through the modules, alternated in one process.

Adds N requests (random prompts of 100-500 tokens, 400 output tokens each, greedy,
ignore_eos) to one engine with `vs_vllm.py`'s settings, runs the prefill phase, then times
blocks of decode steps, switching the model's `layer_stack` off and on between blocks (in
the reverse order every other round, so a drift in the context lengths or the host cancels),
and prints each side's median step and the median of the per-round ratios. Then it splits
the stack side's step: the model's forward (embedding, RoPE tables, the layers), the LM
head with its final norm (`compute_logits`), the sampler, and the rest of the step (the
runner's batch building, the scheduler, the engine's bookkeeping and detokenization).

    python3 -m benchmarks.profile.layer_stack_cost /tmp/vs-vllm/135m-bfloat16 --rows 20 100 200
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time

import torch

from benchmarks.compare.vs_vllm_common import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS
from carpool.llm import LLM
from carpool.sampling_params import SamplingParams


def prefilled_engine(model: str, dtype: str, rows: int, seed: int):
    """An engine whose `rows` requests all have their first token, and its runner."""
    llm = LLM(model=model, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, enable_chunked_prefill=True,
              enable_prefix_caching=False, kv_cache_memory=4 * 2**30, device="cpu", seed=0,
              block_size=16, dtype=dtype)
    engine = llm.engine
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=400, min_tokens=400, ignore_eos=True, temperature=0.0)
    for i in range(rows):
        ids = [rng.randrange(100, 4000) for _ in range(rng.randrange(100, 500))]
        engine.add_request(f"r{i}", ids, params)
    waiting = {f"r{i}" for i in range(rows)}
    while waiting:
        waiting.difference_update(out.request_id for out in engine.step() if out.new_token_ids)
    return engine, engine.runner  # a ModelRunner: one rank


def alternate(engine, model, rounds: int, steps: int) -> dict[str, list[float]]:
    """Per round, the mean step of a block of `steps` with the stack off and one with it on."""
    stack = model.layer_stack
    times: dict[str, list[float]] = {"modules": [], "stack": []}
    try:
        for r in range(rounds):
            for side in ("modules", "stack") if r % 2 == 0 else ("stack", "modules"):
                model.layer_stack = stack if side == "stack" else None
                begin = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                times[side].append((time.perf_counter() - begin) / steps)
    finally:
        model.layer_stack = stack
    return times


def split(engine, runner, steps: int) -> tuple[float, collections.Counter]:
    """The mean step with the stack, and the mean seconds a step spends in each part."""
    parts: collections.Counter = collections.Counter()
    originals = []

    def timed(owner, name: str, part: str) -> None:
        fn = getattr(owner, name)
        originals.append((owner, name))

        def wrapper(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[part] += time.perf_counter() - begin
        setattr(owner, name, wrapper)

    timed(runner.model, "forward", "model forward (the layers)")
    timed(runner.model, "compute_logits", "final norm + LM head")
    timed(runner.sampler, "sample", "sampler")
    try:
        begin = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = (time.perf_counter() - begin) / steps
    finally:
        for owner, name in originals:
            delattr(owner, name)  # the instance attribute goes; the class's method is back
    for part in parts:
        parts[part] /= steps
    return total, parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a checkpoint folder (make_vs_vllm_checkpoints.py)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", type=int, nargs="+", default=[20, 100, 200])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=8, help="decode steps a block")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for rows in args.rows:
        engine, runner = prefilled_engine(args.model, args.dtype, rows, args.seed)
        if runner.model.layer_stack is None:
            raise SystemExit("this model and platform build no layer stack (see "
                             "cpu_layer_stack.KernelLayerStack.of)")
        times = alternate(engine, runner.model, args.rounds, args.steps)
        ratios = [s / m for s, m in zip(times["stack"], times["modules"])]
        print(f"{rows} requests: a decode step {1e3 * statistics.median(times['modules']):.2f} "
              f"ms through the modules, {1e3 * statistics.median(times['stack']):.2f} ms with "
              f"the stack; stack / modules {statistics.median(ratios):.3f} "
              f"(rounds {min(ratios):.3f}-{max(ratios):.3f})")
        total, parts = split(engine, runner, args.rounds * args.steps // 2)
        inside = sum(parts.values())
        for part, seconds in parts.items():
            print(f"  {part:28} {1e3 * seconds:7.2f} ms")
        print(f"  {'rest of the step':28} {1e3 * (total - inside):7.2f} ms  (step {1e3 * total:.2f})")


if __name__ == "__main__":
    main()
