"""llama.cpp on a GGUF file through llama-cpp-python: load, score a token window, greedy decode.

Token ids go in directly (no BOS, no tokenizer), so llama.cpp sees exactly the
ids carpool and transformers see. Runs in the Python that has `llama_cpp`:

    /work/venv-llamacpp/bin/python -m benchmarks.quant.llama_cpp_run FILE.gguf \\
        --prompt-ids 1,2,3 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

N_CTX = 512
THREADS = 2


def open_model(path: str, *, n_ctx: int = N_CTX, threads: int = THREADS, logits_all: bool = True):
    import llama_cpp

    return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                           n_threads=threads, n_threads_batch=threads,
                           logits_all=logits_all, verbose=False)


def window_nll(llm, ids: list[int]) -> tuple[float, int]:
    """(sum of -log p(ids[i] | ids[:i]) for i >= 1, number of terms), from a fresh context."""
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[:len(ids) - 1], dtype=np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(logits).sum(axis=1))
    targets = np.asarray(ids[1:])
    picked = logits[np.arange(len(targets)), targets]
    return float((log_z - picked).sum()), len(targets)


def greedy(llm, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by argmax of llama.cpp's logits, no stop token."""
    llm.reset()
    llm.eval(prompt_ids)
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
        llm.eval([token])
    return out


def tokenize(llm, text: str) -> list[int]:
    """llama.cpp's own tokenization (no BOS, special tokens parsed)."""
    return list(llm.tokenize(text.encode(), add_bos=False, special=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--text", help="also print llama.cpp's tokenization of this text")
    args = parser.parse_args(argv)
    llm = open_model(args.gguf)
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    record = {"greedy": greedy(llm, prompt, args.max_tokens)}
    if args.text is not None:
        record["tokens"] = tokenize(llm, args.text)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
