"""Build the random Llama checkpoint the benchmarks in BENCHMARKS.md were measured on.

No model hub is reachable here, so the benchmark model is a seeded random
Llama written by `carpool.testing.checkpoints.build_checkpoint`, with a
4096-token byte-level BPE tokenizer trained on the standard library. Its
weights are random, so its text is noise; its *cost* per token is that of a
real Llama of the same shape, which is all a scheduling benchmark measures.

    python3 -m benchmarks.make_checkpoint /tmp/bench-llama           # the default shape
    python3 -m benchmarks.make_checkpoint /tmp/big --hidden-size 768 --num-layers 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from carpool.testing.checkpoints import build_checkpoint


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--intermediate-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--num-heads", type=int, default=6)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--max-position-embeddings", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = build_checkpoint(
        args.out_dir, "llama", seed=args.seed, vocab_size=args.vocab_size,
        max_position_embeddings=args.max_position_embeddings, hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads)
    num_params = _count_params(out)
    print(f"wrote {out}: {num_params / 1e6:.1f}M parameters")
    return 0


def _count_params(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                total += _product(f.get_slice(name).get_shape())
    return total


def _product(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    sys.exit(main())
