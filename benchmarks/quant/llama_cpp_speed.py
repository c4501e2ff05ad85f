"""llama.cpp's greedy decode speed on a GGUF file: one stream, and N streams batched.

The reference for carpool's speed on the same file. Uses llama-cpp-python's
low-level API (llama_batch, llama_decode), which is what llama.cpp's own server
does per step: each sequence's prompt is prefilled in one batch, then every step
decodes one token per sequence in one llama_decode call and takes the argmax of
its logits. Decode tok/s = sequences x new tokens / decode time (prefill not
counted). Files and batch sizes are alternated within each round; the figure is
the median over rounds. On a machine other processes share, run it with
OMP_WAIT_POLICY=PASSIVE: llama.cpp's OpenMP threads otherwise spin between ops and steps,
and at 2 threads on 2 busy vCPUs its figures fall 10-30x and scatter (docs/lab/50). The
header line records the setting. Runs in the Python that has `llama_cpp`:

    OMP_WAIT_POLICY=PASSIVE /work/venv-llamacpp/bin/python -m benchmarks.quant.llama_cpp_speed \
        A.gguf B.gguf --seqs 1 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

THREADS = 2
CTX_PER_SEQ = 512


class Model:
    """A llama.cpp model and one context sized for `n_seq` sequences."""

    def __init__(self, path: str, n_seq: int, prompt_len: int, threads: int):
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(
            path.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_seq * CTX_PER_SEQ
        params.n_batch = params.n_ubatch = max(n_seq * prompt_len, 512)
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make a context")
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        self.batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(entries)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax(self, i: int) -> int:
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i),
                                       shape=(self.n_vocab,))
        return int(logits.argmax())

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def run_once(m: Model, n_seq: int, prompt: list[int], new_tokens: int) -> float:
    """Prefill every sequence's prompt, then decode `new_tokens` each; returns decode tok/s."""
    m.clear()
    n = len(prompt)
    m.decode([(t, p, s, p == n - 1) for s in range(n_seq) for p, t in enumerate(prompt)])
    next_tokens = [m.argmax(s * n + n - 1) for s in range(n_seq)]
    start = time.perf_counter()
    for step in range(new_tokens):
        m.decode([(next_tokens[s], n + step, s, True) for s in range(n_seq)])
        next_tokens = [m.argmax(s) for s in range(n_seq)]
    return n_seq * new_tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="+")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=THREADS)
    args = parser.parse_args(argv)
    if args.prompt_len + args.new_tokens > CTX_PER_SEQ:
        raise ValueError(f"--prompt-len + --new-tokens must fit {CTX_PER_SEQ}")
    prompt = [(17 + 31 * i) % 256 for i in range(args.prompt_len)]  # any ids; speed only
    models = {(path, n): Model(path, n, args.prompt_len, args.threads)
              for path in args.gguf for n in args.seqs}
    results: dict[tuple[str, int], list[float]] = {key: [] for key in models}
    for r in range(args.rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for key in order:
            results[key].append(run_once(models[key], key[1], prompt, args.new_tokens))
    print(f"threads {args.threads}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens per sequence, "
          f"median of {args.rounds} rounds")
    for (path, n), rates in results.items():
        print(f"{path.rsplit('/', 1)[-1]:<32} {n:>3} seq  {statistics.median(rates):8.1f} tok/s  "
              f"(rounds: {', '.join(f'{x:.1f}' for x in rates)})")
    for m in models.values():
        m.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
