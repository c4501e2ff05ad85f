"""What grammar-constrained decoding costs: output tokens/s of a batch in which half the
requests follow a JSON schema vs the same batch with none constrained, in one process,
alternating variants over rounds (ratios, not absolute speed, are the point).

Every request samples at temperature 1.0 and produces exactly `--max-tokens` tokens: the
unconstrained ones with ignore_eos, the constrained ones under a schema (a list of at least
50 objects) that cannot complete sooner. Also reported, per step with constrained rows:
the time the helper thread spends filling the bitmask (overlapping the forward) and the
time the sampler spends applying it (on the step's critical path).

    python3 -m benchmarks.features.structured_cost                       # the built-in model
    python3 -m benchmarks.features.structured_cost /tmp/vs-vllm/135m-float32 --max-model-len 512
"""

from __future__ import annotations

import argparse
import statistics
import time

from carpool import LLM, SamplingParams, StructuredOutputsParams
from carpool.runner import sampler as sampler_module
from carpool.structured import bitmask as bitmask_module

SCHEMA = {"type": "object", "required": ["items"], "properties": {"items": {
    "type": "array", "minItems": 50, "items": {
        "type": "object", "required": ["name", "qty"], "additionalProperties": False,
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "qty": {"type": "integer"}}}}}}


class Timer:
    """Wraps a function and adds up the seconds spent in it (per call list)."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name, self.original = owner, name, getattr(owner, name)
        self.seconds: list[float] = []
        timer = self

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return timer.original(*args, **kwargs)
            finally:
                timer.seconds.append(time.perf_counter() - start)

        setattr(owner, name, timed)


def run(llm: LLM, num_requests: int, max_tokens: int, constrained: bool) -> tuple[float, float]:
    """(output tokens per wall second, per CPU second of this process)."""
    structured = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True,
                             structured_outputs=structured if constrained and i % 2 else None)
              for i in range(num_requests)]
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(["List the items as JSON:"] * num_requests, params, use_tqdm=False)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert num_tokens == num_requests * max_tokens, num_tokens
    return num_tokens / seconds, num_tokens / cpu_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args()
    llm = LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=args.num_requests)
    fill = Timer(bitmask_module.BitmaskFiller, "fill")
    apply = Timer(sampler_module, "apply_grammar_bitmask")
    run(llm, 4, 8, True)  # warm-up: compile the grammar, start the helper thread
    fill.seconds.clear()
    apply.seconds.clear()
    rates: dict[str, list[tuple[float, float]]] = {"none": [], "half": []}
    for round_ in range(args.rounds):
        order = ("none", "half") if round_ % 2 == 0 else ("half", "none")
        for variant in order:
            rates[variant].append(run(llm, args.num_requests, args.max_tokens,
                                      variant == "half"))
            wall, cpu = rates[variant][-1]
            print(f"round {round_} {variant:>4}: {wall:8.1f} output tok/s wall, "
                  f"{cpu:8.1f} per CPU second", flush=True)
    print(f"model {args.model or 'built-in'}: {args.num_requests} requests x "
          f"{args.max_tokens} tokens, temperature 1.0")
    for column, clock in enumerate(("wall", "CPU")):
        none = statistics.median(r[column] for r in rates["none"])
        half = statistics.median(r[column] for r in rates["half"])
        print(f"median output tok/s ({clock}): none constrained {none:.1f}, half constrained "
              f"{half:.1f}, ratio {half / none:.3f} (loss {100 * (1 - half / none):.1f}%)")
    print(f"per step with constrained rows ({args.num_requests // 2} of them): bitmask fill "
          f"median {1e3 * statistics.median(fill.seconds):.2f} ms (helper thread, beside the "
          f"forward); mask apply median {1e3 * statistics.median(apply.seconds):.2f} ms "
          f"(sampler)")


if __name__ == "__main__":
    main()
