"""transformers' mean NLL per token on the held-out windows, for GGUF files or a checkpoint.

The same figure as `benchmarks.quant.llama_cpp_nll`, from the outside reference:
transformers dequantizes a GGUF file to float weights on load and computes in
float32, as carpool does with float activations; llama.cpp instead rounds
activations to 8 bits in its quantized matmuls. Needs `accelerate` for GGUF files.

    python3 -m benchmarks.quant.heldout_tokens /tmp/heldout.json
    python3 -m benchmarks.quant.transformers_nll /tmp/heldout.json carpool/default_model A.gguf
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def load(path: Path):
    import transformers

    if path.suffix == ".gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()


def mean_nll(model, windows: list[list[int]]) -> tuple[float, int]:
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for ids in windows:
            x = torch.tensor([ids])
            logprobs = torch.log_softmax(model(x).logits[0, :-1].double(), dim=-1)
            total -= logprobs[torch.arange(len(ids) - 1), x[0, 1:]].sum().item()
            count += len(ids) - 1
    return total / count, count


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heldout", help="JSON from benchmarks.quant.heldout_tokens")
    parser.add_argument("models", nargs="+", help="GGUF files or checkpoint folders")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with open(args.heldout) as f:
        heldout = json.load(f)
    print(f"held-out: {heldout['num_windows']} windows of {heldout['window']} ids "
          f"(python {heldout['python']}, sha256 {heldout['sha256'][:16]})")
    for name in args.models:
        start = time.perf_counter()
        nll, count = mean_nll(load(Path(name)), heldout["windows"])
        print(f"{Path(name).name:<32} nll {nll:.5f} nats/token over {count} tokens "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
