"""Quantize a GGUF file with llama.cpp's own quantizer, through llama-cpp-python's library API.

llama-cpp-python's wheel ships libllama but no `llama-quantize` binary;
`llama_model_quantize` is the function that binary calls, with the same defaults
(the per-tensor type choices of a "mostly" file type, its fallbacks for shapes a
block type cannot hold). Runs in the Python that has `llama_cpp`:

    /work/venv-llamacpp/bin/python -m benchmarks.quant.llama_cpp_quantize IN.gguf OUT.gguf Q4_K_M
"""

from __future__ import annotations

import argparse
import sys

# llama.h's llama_ftype names for the file types the fixtures use.
FILE_TYPES = ("F16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")


def ftype_value(llama_cpp, name: str) -> int:
    if name not in FILE_TYPES:
        raise ValueError(f"file type must be one of {FILE_TYPES}, got {name!r}")
    return getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")


def quantize(src: str, dst: str, file_type: str, threads: int = 2) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype_value(llama_cpp, file_type)
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {file_type}) returned {rc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("file_type", choices=FILE_TYPES)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    quantize(args.src, args.dst, args.file_type, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
