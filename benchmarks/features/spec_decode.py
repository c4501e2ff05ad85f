"""Speculative decoding (n-gram, or a draft model) on and off at one stream: inter-token
latency per workload, acceptance, and what a (1 + k)-token verify step costs against a
1-token decode step.

One process holds both engines (same model, same threads, prefix caching off); every round
runs each workload on each side, the side order alternating between rounds. A workload is
one request, greedy unless it says otherwise, `max_tokens` outputs with EOS ignored (under
a grammar, `json-quote`, up to `max_tokens`: it ends where its grammar completes); its
ITL is (last token time - first token time) / (outputs - 1), so the prompt's prefill is left
out, and its CPU time per output token is the process's CPU time for the request less that
of the same request with max_tokens=1 (its prefill), over outputs - 1: on a shared machine
the CPU clock is steadier than the wall clock.

    python3 -m benchmarks.features.spec_decode --model /work/vs-vllm/135m-bfloat16 \
        --threads 2 --rounds 3
    python3 -m benchmarks.features.spec_decode --model /work/vs-vllm/135m-bfloat16 \
        --method draft_model --draft-layers 3 --k 3 --threads 2 --rounds 3

`--method draft_model` drafts with `--draft` (a folder sharing the target's tokenizer) or,
with `--draft-layers N`, a copy of the target truncated to its first N layers (written to a
temporary folder: the built-in model's vocabulary is not the 135M's).

Feeds BENCHMARKS.md "Speculative decoding" and docs/lab/55-speculative-decoding.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from benchmarks.features.spec_prompts import JSON_QUOTE, RECORD_SCHEMA
from benchmarks.features.spec_prompts import WORKLOADS as PROMPT_WORKLOADS
from carpool import LLM, SamplingParams, StructuredOutputsParams
from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput
from carpool.testing.checkpoints import truncated_checkpoint

WORKLOADS = {
    **PROMPT_WORKLOADS,
    # a grammar (JSON schema) whose output copies records from the prompt
    "json-quote": (JSON_QUOTE,
                   dict(structured_outputs=StructuredOutputsParams(json=RECORD_SCHEMA))),
}

def itl_and_counts(llm: LLM, prompt: str, max_tokens: int,
                   extra: dict) -> tuple[float, float, tuple]:
    """(wall ITL, CPU seconds per output token after the first, spec counters' increase)."""
    before = llm.stats()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            **({"temperature": 0.0} | extra))
    cpu = time.process_time()
    llm.generate([prompt], SamplingParams(max_tokens=1, **({"temperature": 0.0} | extra)),
                 use_tqdm=False)
    prefill_cpu = time.process_time() - cpu
    cpu = time.process_time()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    cpu = time.process_time() - cpu
    metrics = out.metrics[0]
    num_outputs = len(out.outputs[0].token_ids)
    itl = (metrics.last_token_time - metrics.first_token_time) / (num_outputs - 1)
    after = llm.stats()
    counts = tuple(getattr(after, n) - getattr(before, n) for n in (
        "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens"))
    return itl, (cpu - prefill_cpu) / (num_outputs - 1), counts


def verify_step_cost(llm: LLM, k: int, position: int, repeats: int) -> tuple[float, float]:
    """Median seconds of a decode step with 1 token and with 1 + k tokens (one request at
    `position`, on an idle engine's KV blocks)."""
    runner = llm.engine.runner
    block_size = llm.engine.scheduler_config.block_size
    blocks = list(range(-(-(position + k + 1) // block_size)))
    greedy = SamplingParams(temperature=0.0)

    def step(num_drafts: int) -> float:
        drafts = [7] * num_drafts
        request = ScheduledRequest("verify", [5, *drafts], position, blocks, True, greedy,
                                   [5] * position, [], drafts)
        start = time.perf_counter()
        runner.execute(SchedulerOutput(scheduled=[request]))
        return time.perf_counter() - start
    times: dict[int, list[float]] = {0: [], k: []}
    for i in range(repeats):
        for num_drafts in ((0, k) if i % 2 == 0 else (k, 0)):
            times[num_drafts].append(step(num_drafts))
    return statistics.median(times[0]), statistics.median(times[k])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: built-in)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="comma-separated; empty: only the verify-step cost")
    parser.add_argument("--method", default="ngram", choices=("ngram", "draft_model"))
    parser.add_argument("--draft", default=None, help="draft_model: the draft's folder")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="draft_model: the target's first N layers as the draft")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
            "prompt_lookup_max": 5}
    if args.method == "draft_model":
        draft = args.draft
        if draft is None:
            if args.model is None or args.draft_layers is None:
                parser.error("--method draft_model needs --draft, or --model and "
                             "--draft-layers")
            draft = str(truncated_checkpoint(args.model, tempfile.mkdtemp(prefix="draft-"),
                                             args.draft_layers))
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k}
    common = dict(model=args.model, max_model_len=512, num_kv_blocks=128,
                  enable_prefix_caching=False)
    sides = {"off": LLM(**common)}
    names = [name for name in args.workloads.split(",") if name]
    if names:
        sides["ngram"] = LLM(**common, speculative_config=spec)  # (the speculating side)
    for llm in sides.values():  # warm up both
        itl_and_counts(llm, WORKLOADS["novel-greedy"][0], 16, {})
    itls = {(w, s): [] for w in names for s in sides}
    cpus = {(w, s): [] for w in names for s in sides}
    counts = {w: (0, 0, 0) for w in names}
    for round_index in range(args.rounds):
        order = list(sides) if round_index % 2 == 0 else list(sides)[::-1]
        for workload in names:
            prompt, extra = WORKLOADS[workload]
            for side in order:
                itl, cpu, c = itl_and_counts(sides[side], prompt, args.max_tokens, extra)
                itls[(workload, side)].append(itl)
                cpus[(workload, side)].append(cpu)
                if side == "ngram":
                    counts[workload] = tuple(a + b for a, b in zip(counts[workload], c))
    method = args.method if args.method == "ngram" else f"draft_model ({spec['model']})"
    print(f"model {args.model or 'built-in'}, {method}, {args.threads} threads, "
          f"{args.rounds} rounds, {args.max_tokens} tokens, k={args.k}")
    print(f"workload | ITL off / {args.method} ms | wall speed-up, median (rounds) | "
          "CPU ms/token off / "
          f"{args.method} | CPU speed-up, median (rounds) | acceptance | mean acceptance length")
    for workload in names:
        cells = []
        for table in (itls, cpus):
            off, on = table[(workload, "off")], table[(workload, "ngram")]
            ratios = [a / b for a, b in zip(off, on)]
            cells += [f"{1e3 * statistics.median(off):.2f} / {1e3 * statistics.median(on):.2f}",
                      f"{statistics.median(ratios):.2f}x "
                      f"({', '.join(f'{r:.2f}' for r in ratios)})"]
        drafts, draft_tokens, accepted = counts[workload]
        rate = accepted / draft_tokens if draft_tokens else 0.0
        length = 1 + accepted / drafts if drafts else 1.0
        print(f"{workload} | {' | '.join(cells)} | {100 * rate:.0f}% of {draft_tokens} in "
              f"{drafts} drafts | {length:.2f}")
    for position in (64, 320):
        one, many = verify_step_cost(sides["off"], args.k, position, 30)
        print(f"verify step at position {position}: 1 token {1e3 * one:.2f} ms, "
              f"1 + {args.k} tokens {1e3 * many:.2f} ms ({many / one:.2f}x)")
    for llm in sides.values():
        llm.close()


if __name__ == "__main__":
    main()
