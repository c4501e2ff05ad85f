"""llama.cpp's mean negative log-likelihood per token on held-out windows, for a GGUF file.

The reference figure for carpool's prompt logprobs on the same file: each window
(from `benchmarks.quant.heldout_tokens`, the built-in model's held-out text) is
scored from a fresh context of 512 tokens, ids fed directly, threads=2; the figure
is the mean of -log p over every predicted token of every window (nats/token).

    python3 -m benchmarks.quant.heldout_tokens /tmp/heldout.json
    /work/venv-llamacpp/bin/python -m benchmarks.quant.llama_cpp_nll /tmp/heldout.json A.gguf B.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks.quant.llama_cpp_run import N_CTX, THREADS, open_model, window_nll


def mean_nll(path: str, windows: list[list[int]], threads: int = THREADS) -> dict:
    llm = open_model(path, threads=threads)
    total, count = 0.0, 0
    start = time.perf_counter()
    for ids in windows:
        if len(ids) > N_CTX:
            raise ValueError(f"window of {len(ids)} ids does not fit n_ctx {N_CTX}")
        nll, n = window_nll(llm, ids)
        total += nll
        count += n
    return {"file": os.path.basename(path), "nll": total / count, "tokens": count,
            "seconds": round(time.perf_counter() - start, 2)}


def tokenizer_mismatches(path: str, heldout: dict) -> int:
    """Documents whose llama.cpp tokenization differs from the ids in the windows (0 = same).

    The windows are the documents' Hugging Face ids, each followed by `<|endoftext|>`;
    llama.cpp's tokenizer, on the GGUF's vocabulary, must give the same stream.
    """
    from benchmarks.quant.llama_cpp_run import tokenize

    llm = open_model(path, logits_all=False)
    eos = llm.token_eos()
    stream = [t for w in heldout["windows"] for t in w]
    bad = pos = 0
    for doc in heldout["documents"]:
        ids = tokenize(llm, doc) + [eos]
        want = stream[pos:pos + len(ids)]  # the last document runs past the windows
        bad += ids[:len(want)] != want
        pos += len(ids)
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heldout", help="JSON from benchmarks.quant.heldout_tokens")
    parser.add_argument("gguf", nargs="+")
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--check-tokenizer", action="store_true",
                        help="first check llama.cpp tokenizes the text to the same ids")
    args = parser.parse_args(argv)
    with open(args.heldout) as f:
        heldout = json.load(f)
    print(f"held-out: {heldout['num_windows']} windows of {heldout['window']} ids "
          f"(python {heldout['python']}, sha256 {heldout['sha256'][:16]})")
    if args.check_tokenizer:
        bad = tokenizer_mismatches(args.gguf[0], heldout)
        print(f"llama.cpp's tokenization of the {len(heldout['documents'])} documents behind "
              f"the windows: {bad} differ from the Hugging Face ids")
    for path in args.gguf:
        r = mean_nll(path, heldout["windows"], args.threads)
        print(f"{r['file']:<32} nll {r['nll']:.5f} nats/token over {r['tokens']} tokens "
              f"({r['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
