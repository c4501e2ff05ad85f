"""Fed docs/lab/16-batch-invariant-mode.md.

Which op first breaks batch invariance, fix by fix (issue 19): `OpTrace` on a real shape.

One request (greedy, --max-tokens out) runs alone, then inside a batch of --batch mixed
random prompts with the step budget at --budget tokens (its prompt chunked beside decodes),
each run traced op by op (`carpool.testing.op_trace`); the first op whose rows differ
bitwise is printed for four engines: the default, the default with only the linears on
fixed row tiles, the default with only the attention in the invariant kernel, and
`batch_invariant=True` (both). The two partial engines are the default one with the
mode's pieces switched on by hand after loading, for this measurement only.

    python3 -m benchmarks.archive.first_differing_op /tmp/vs-vllm/135m-bfloat16 --dtype float32
    python3 -m benchmarks.archive.first_differing_op /tmp/vs-vllm/135m-bfloat16 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import random
import sys

from carpool import SamplingParams
from carpool.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.platform.cpu_invariant_linear import tile_linears
from carpool.testing.op_trace import OpTrace, first_difference


def engine_for(model: str, dtype: str, variant: str, budget: int) -> LLMEngine:
    config = EngineConfig.from_args(model, dtype=dtype, batch_invariant=variant == "mode",
                                    enable_prefix_caching=False, max_num_batched_tokens=budget)
    engine = LLMEngine.from_config(config, detokenize=False)
    if variant == "linears only":
        tile_linears(engine.runner.model)
    if variant == "attention only":
        engine.runner.attention.batch_invariant = True
    return engine


def traced(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> OpTrace:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with OpTrace(engine, "r0") as trace:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
    return trace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, 4000) for _ in range(rng.randint(8, 120))]
               for _ in range(args.batch)]
    for variant in ("default", "linears only", "attention only", "mode"):
        alone_engine = engine_for(args.model, args.dtype, variant, 2048)
        alone = traced(alone_engine, prompts[:1], args.max_tokens)
        batched = traced(engine_for(args.model, args.dtype, variant, args.budget), prompts,
                         args.max_tokens)
        difference = first_difference(alone, batched)
        print(f"{args.dtype} {variant}: first differing op "
              f"{difference if difference is not None else 'none'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
