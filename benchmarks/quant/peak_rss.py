"""Peak resident memory of carpool serving a model: load it, generate 16 tokens after a
295-token prompt with a fixed KV pool, print the peak RSS against the file's size plus the KV
cache's (issue 60's target: no more than 15% above their sum).

    python3 benchmarks/quant/peak_rss.py /work/gguf/0.5b-lc-Q4_K_M.gguf

With `--llama-cpp`, run in the Python that has `llama_cpp` (no carpool, no torch imported),
the same for llama.cpp on the same GGUF file (context 1,024, 2 threads, the same prompt ids),
its KV cache counted as its context's float16 keys and values:

    /work/venv-llamacpp/bin/python benchmarks/quant/peak_rss.py FILE.gguf --llama-cpp
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

PROMPT_IDS = list(range(5, 300))  # 295 tokens
MAX_TOKENS = 16
CONTEXT = 1024


def weights_bytes(path: str) -> int:
    """A file's size, or a folder's safetensors files'."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def carpool_kv_bytes(path: str) -> int:
    """Load and run carpool; its KV pool's bytes."""
    from carpool import LLM, SamplingParams

    llm = LLM(path, dtype="bfloat16", max_model_len=CONTEXT, num_kv_blocks=256)
    llm.generate([{"prompt_token_ids": PROMPT_IDS}],
                 SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
    return llm.engine.kv_cache_info["bytes"]


def llama_cpp_kv_bytes(path: str) -> int:
    """Load and run llama.cpp (llama-cpp-python); its float16 KV cache's bytes."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=CONTEXT, n_threads=2, n_threads_batch=2,
                          verbose=False)
    llm.create_completion(PROMPT_IDS, max_tokens=MAX_TOKENS, temperature=0.0)
    meta = llm.metadata
    arch = meta["general.architecture"]
    layers = int(meta[f"{arch}.block_count"])
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta[f"{arch}.embedding_length"]) // heads
    return 2 * layers * kv_heads * head_dim * CONTEXT * 2


def main() -> int:
    path, llama_cpp = sys.argv[1], "--llama-cpp" in sys.argv[2:]
    if not llama_cpp:
        from carpool import LLM  # noqa: F401  (the baseline holds Python, torch and carpool)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    kv = llama_cpp_kv_bytes(path) if llama_cpp else carpool_kv_bytes(path)
    size = weights_bytes(path)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"RSS {path}: file {size / 2**20:.0f} MiB, KV {kv / 2**20:.0f} MiB, peak RSS "
          f"{peak / 2**20:.0f} MiB, ratio to file+KV {peak / (size + kv):.2f}; the process "
          f"before loading {baseline / 2**20:.0f} MiB, peak above it "
          f"{(peak - baseline) / (size + kv):.2f} x file+KV")
    return 0


if __name__ == "__main__":
    sys.exit(main())
