"""Where a continuous step's extra cost over a static one goes: CPU time per step, by phase.

Runs §18's short/long mix (`carpool bench offline --workload mix`, the same requests and
engine settings) under the static and the continuous scheduler, alternated for `--rounds`,
one thread, and times each phase of every step on the thread's CPU clock by wrapping it:
the scheduler's `schedule` and `update`, batch building, the attention metadata, the model
forward (and inside it the attention layers), the logits, the sampler, the per-request
output building (`LLMEngine._advance`, detokenization included) and `LLMEngine.stats`.
Prints, for each variant's quickest round, each phase in µs per step, and the difference.

Continuous batching takes ~2x fewer steps than static batching here, and the ratio of their
throughputs is (static steps x F + W) / (continuous steps x F + W), F the cost that comes
with every step and W the per-token work both runs do once per token: a phase whose cost
per step grows with the live rows of a step (continuous runs ~8, static ~3.7 with padding
for the finished ones) is W, and only cutting W raises the ratio.

    OMP_NUM_THREADS=1 python3 -m benchmarks.profile.step_phases /tmp/hostwork/llama-300k --rounds 3

`--variants A,B` compares two other `bench offline` variants the same way (the difference is
B - A), e.g. `chunked-no-prefix-cache,continuous` for what prefix caching costs a step.
"""

from __future__ import annotations

import argparse
import sys
import time

PHASES = ("step", "schedule", "batch", "metadata", "forward", "attention", "logits", "sample",
          "update", "outputs", "stats")


class PhaseClock:
    """CPU seconds per phase, accumulated by the methods `wrap` replaced."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, name: str, phase: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.thread_time() - start

        setattr(owner, name, timed)

    def install(self, engine) -> None:
        for owner, name, phase in (
                (engine, "step", "step"), (engine.scheduler, "schedule", "schedule"),
                (engine.scheduler, "update", "update"), (engine, "_advance", "outputs"),
                (engine, "stats", "stats"), (engine.runner.model, "forward", "forward"),
                (engine.runner.model, "compute_logits", "logits"),
                (engine.runner.sampler, "sample", "sample"),
                (engine.runner.attention, "build_metadata", "metadata"),
                (engine.runner.attention, "attend", "attention")):
            self.wrap(owner, name, phase)


def run(model: str, rounds: int, pair: tuple[str, str] = ("static", "continuous")
        ) -> dict[str, list[dict[str, float]]]:
    """{variant: [µs per step by phase, one dict per round]}."""
    import torch

    import carpool.runner.model_runner as model_runner
    from carpool.bench import offline
    from carpool.bench.workloads import WorkloadConfig, build_workload
    from carpool.engine.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    clock = PhaseClock()
    clock.wrap(model_runner, "build_input_batch", "batch")
    build_engine = offline.build_engine

    def timed_engine(model_path, kwargs):
        engine = build_engine(model_path, kwargs)  # its warm-up request is not timed
        clock.install(engine)
        clock.seconds.clear()
        return engine

    offline.build_engine = timed_engine
    workload = WorkloadConfig(name="mix", num_prompts=64, input_len=64, short_output_len=8,
                              long_output_len=128)
    requests = build_workload(workload, load_tokenizer(model))
    max_model_len = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    common = {"max_num_seqs": 8}
    results: dict[str, list[dict[str, float]]] = {}
    for index in range(rounds):
        variants = pair if index % 2 == 0 else pair[::-1]
        for variant in variants:
            result = offline.run_variant(model, requests, variant, common, max_model_len, "cpu")
            num_steps = len(result.steps)
            results.setdefault(variant, []).append(
                {phase: 1e6 * seconds / num_steps for phase, seconds in clock.seconds.items()}
                | {"steps": num_steps})
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="static,continuous",
                        help="two bench offline variants, A,B (the difference is B - A)")
    args = parser.parse_args()
    pair = tuple(args.variants.split(","))
    if len(pair) != 2:
        parser.error("--variants takes two variants, A,B")
    results = run(args.model, args.rounds, pair)
    # each variant's quickest round, whole (the phases of one round add up; on a shared host
    # the slow rounds are the ones other work landed in)
    best = {variant: min(rounds, key=lambda r: r["step"]) for variant, rounds in results.items()}
    print(f"µs per step, each variant's quickest of {args.rounds} rounds")
    width = max(12, *(len(v) + 1 for v in pair))
    print(f"{'':{width}s}{'steps':>7s}" + "".join(f"{phase:>10s}" for phase in PHASES))
    for variant in pair:
        phases, steps = best[variant], results[variant][0]["steps"]
        print(f"{variant:{width}s}{steps:7d}" + "".join(f"{phases.get(p, 0.0):10.1f}"
                                                        for p in PHASES))
    first, second = best[pair[0]], best[pair[1]]
    print(f"{'difference':{width}s}{'':7s}" + "".join(
        f"{second.get(p, 0.0) - first.get(p, 0.0):+10.1f}" for p in PHASES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
