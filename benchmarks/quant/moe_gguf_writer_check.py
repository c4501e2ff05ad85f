"""The tests' GGUF writer against llama.cpp's converter on mixtures of experts, byte for byte.

`tests/engine/test_moe_gguf_equivalence.py` writes its MoE files with
`carpool.testing.gguf_writer` (llama.cpp's converter cannot run inside the test suite). This
makes the tiny Qwen3-MoE, Mixtral and Qwen2-MoE checkpoints the tests make (seed 0, every
layer sparse), converts each with llama.cpp's own `convert_hf_to_gguf.py`
(`llama_cpp_convert`, in the converter's Python) to F32, F16, BF16 and Q8_0, writes the same
with the writer, and compares every tensor (name, type, shape, bytes) and the expert and
size metadata. Prints one line per file; exits 1 on any difference.

    python3 -m benchmarks.quant.moe_gguf_writer_check /tmp/moe-writer-check \\
        --llama-cpp-dir /work/llamacpp-sdist/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        --convert-python /work/venv-convert/bin/python
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
ARCHS = {"qwen3_moe": dict(mlp_only_layers=[]), "mixtral": {},
         "qwen2_moe": dict(decoder_sparse_step=1)}
TYPES = ("f32", "f16", "bf16", "q8_0")


def differences(ours: Path, theirs: Path) -> list[str]:
    from gguf import GGUFReader

    a, b = GGUFReader(str(ours)), GGUFReader(str(theirs))
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    found = [f"tensor {n} only in one file" for n in sorted(set(ta) ^ set(tb))]
    for name in sorted(set(ta) & set(tb)):
        x, y = ta[name], tb[name]
        if x.tensor_type != y.tensor_type or x.data.shape != y.data.shape or not np.array_equal(
                np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8)):
            found.append(f"tensor {name}: {x.tensor_type.name} {x.data.shape} against "
                         f"{y.tensor_type.name} {y.data.shape}")
    for key in b.fields:
        if any(k in key for k in ("expert", "feed_forward", "block_count")):
            mine = a.get_field(key)
            if mine is None or mine.contents() != b.get_field(key).contents():
                found.append(f"metadata {key}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--llama-cpp-dir", required=True)
    parser.add_argument("--convert-python", required=True)
    args = parser.parse_args()
    from carpool.testing.checkpoints import build_checkpoint
    from carpool.testing.gguf_writer import write_gguf

    out = Path(args.out_dir)
    failed = False
    for arch, overrides in ARCHS.items():
        checkpoint = build_checkpoint(out / arch, arch, initializer_range=0.2, **overrides)
        for kind in TYPES:
            theirs = out / f"{arch}-{kind}-llama-cpp.gguf"
            subprocess.run([args.convert_python, "-m", "benchmarks.quant.llama_cpp_convert",
                            args.llama_cpp_dir, str(checkpoint), "--outfile", str(theirs),
                            "--outtype", kind], cwd=ROOT, check=True, capture_output=True)
            ours = write_gguf(checkpoint, out / f"{arch}-{kind}-writer.gguf", kind.upper())
            found = differences(ours, theirs)
            failed |= bool(found)
            print(f"{arch} {kind}: {'identical' if not found else '; '.join(found[:5])}",
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
