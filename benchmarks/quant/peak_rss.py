"""Peak resident memory of carpool serving a model: load it, generate 16 tokens after a
295-token prompt with a fixed KV pool, print the peak RSS against the file's size plus the KV
cache's (issue 60's target: no more than 15% above their sum).

    python3 benchmarks/quant/peak_rss.py /work/gguf/0.5b-lc-Q4_K_M.gguf
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

from carpool import LLM, SamplingParams


def weights_bytes(path: str) -> int:
    """A file's size, or a folder's safetensors files'."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def main() -> int:
    path = sys.argv[1]
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Python + torch
    llm = LLM(path, dtype="bfloat16", max_model_len=1024, num_kv_blocks=256)
    llm.generate([{"prompt_token_ids": list(range(5, 300))}],
                 SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    kv = llm.engine.kv_cache_info["bytes"]
    size = weights_bytes(path)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"RSS {path}: file {size / 2**20:.0f} MiB, KV {kv / 2**20:.0f} MiB, peak RSS "
          f"{peak / 2**20:.0f} MiB, ratio to file+KV {peak / (size + kv):.2f}; the process "
          f"before loading {baseline / 2**20:.0f} MiB, peak above it "
          f"{(peak - baseline) / (size + kv):.2f} x file+KV")
    return 0


if __name__ == "__main__":
    sys.exit(main())
