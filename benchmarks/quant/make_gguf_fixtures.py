"""Write GGUF files with llama.cpp's own converter and quantizer, and check them with transformers.

carpool's GGUF loader must read what llama.cpp's tools write, so the fixtures are
made by those tools, not by carpool or by hand: tiny seeded Hugging Face
checkpoints of the four architectures (shapes where the K-quants apply: hidden 256,
MLP 512, head_dim 64, or 128 for qwen3) and the built-in model are converted to F32 (and F16 for the
built-in) by `convert_hf_to_gguf.py`, then quantized by `llama_model_quantize`.
Every file is read back with `gguf.GGUFReader` (its tensor types are printed) and
with transformers, whose tokenizer must equal the checkpoint's and whose greedy
tokens are compared with llama.cpp's on the same file. `--fixtures-dir` copies the
small set the tests use (COMMITTED) there with a manifest.

Needs three Pythons' worth of tools: this one with torch, transformers,
sentencepiece and accelerate (the converter imports sentencepiece; transformers'
GGUF loading needs accelerate), llama.cpp's source tree (the llama-cpp-python
sdist's vendor/llama.cpp), and a Python with llama-cpp-python:

    /work/venv-convert/bin/python -m benchmarks.quant.make_gguf_fixtures /tmp/gguf \\
        --llama-cpp-dir /work/llamacpp-sdist/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        --llama-python /work/venv-llamacpp/bin/python --fixtures-dir tests/fixtures/gguf
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.quant import gguf_checks

ROOT = Path(__file__).resolve().parents[2]
TINY_VOCAB = 512
TINY_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
# Per architecture, on top of TINY_SHAPE: qwen2 has q/k/v biases by construction and is
# tied, as Qwen2's small models are; qwen3 has q/k norms by construction, and head_dim 128
# (not hidden / heads = 64) because transformers' GGUF loader does not read head_dim
# from the file for qwen3 and takes Qwen3Config's default, 128 (as in real Qwen3 models).
ARCH_EXTRA = {"llama": {}, "mistral": {}, "qwen2": {"tie_word_embeddings": True},
              "qwen3": {"head_dim": 128}}
TINY_QUANTS = ("Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")
BUILTIN = "carpool-default"
BUILTIN_QUANTS = ("Q8_0", "Q4_K_M", "Q4_0")
# What the tests need from llama.cpp itself: K-quant files (the gguf package cannot write
# K-quants), one per architecture, and the built-in model's for the NLL comparison. Q8_0
# and Q4_0 are left out: the gguf package quantizes them byte for byte as llama.cpp does
# (checked on every such tensor here), so tests write their own.
COMMITTED = tuple(f"tiny-{arch}-Q4_K_M.gguf" for arch in ARCH_EXTRA) + (f"{BUILTIN}-Q4_K_M.gguf",)


def build_tiny(hf_root: Path, arch: str) -> Path:
    from carpool.testing.checkpoints import build_checkpoint

    shape = dict(TINY_SHAPE, **ARCH_EXTRA[arch])
    return build_checkpoint(hf_root / f"tiny-{arch}", arch, seed=0, vocab_size=TINY_VOCAB,
                            max_position_embeddings=512, **shape)


def convert(llama_cpp_dir: Path, model_dir: Path, out: Path, outtype: str, name: str) -> None:
    # llama.cpp writes Mistral as the llama architecture. transformers would load a file
    # named exactly "mistral" as Mistral, then fail (its gguf has no "mistral" tensor map),
    # so names are the file stems ("tiny-mistral"), and that file loads as Llama.
    _run([sys.executable, "-m", "benchmarks.quant.llama_cpp_convert", str(llama_cpp_dir),
          str(model_dir), "--outfile", str(out), "--outtype", outtype, "--model-name", name])


def quantize(llama_python: str, src: Path, dst: Path, file_type: str) -> str:
    """Quantize; returns llama.cpp's log lines about fallbacks (shapes a type cannot hold)."""
    log = _run([llama_python, "-m", "benchmarks.quant.llama_cpp_quantize", str(src), str(dst),
                file_type])
    return "\n".join(line for line in log.splitlines() if "falling back" in line)


def llama_cpp_greedy(llama_python: str, path: Path, prompt: list[int], n: int) -> list[int]:
    out = _run([llama_python, "-m", "benchmarks.quant.llama_cpp_run", str(path),
                "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", str(n)])
    return json.loads(out.strip().splitlines()[-1])["greedy"]


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout + proc.stderr


def check(path: Path, hf_dir: Path, f32: Path, llama_python: str) -> dict:
    types = gguf_checks.tensor_types(path)
    same, writable = gguf_checks.gguf_package_requantizes(path, f32)
    meta = gguf_checks.metadata(path)
    hf = gguf_checks.check_with_transformers(path, hf_dir)
    ours = llama_cpp_greedy(llama_python, path, hf["prompt_ids"], len(hf["greedy"]))
    agree = next((i for i, (a, b) in enumerate(zip(ours, hf["greedy"])) if a != b), len(ours))
    record = {"file": path.name, "bytes": path.stat().st_size,
              "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "metadata": meta,
              "types": types, "summary": gguf_checks.type_summary(types),
              "transformers_class": hf["model_class"], "prompt_ids": hf["prompt_ids"],
              "transformers_greedy": hf["greedy"], "llama_cpp_greedy": ours,
              "greedy_prefix_agreement": agree, "gguf_package_same_bytes": [same, writable]}
    print(f"{path.name:<30} {record['bytes']:>9} B  {record['summary']}\n"
          f"{'':<30} {hf['model_class']}; greedy: llama.cpp and transformers agree on "
          f"{agree}/{len(ours)} tokens; the gguf package writes {same} of the {writable} "
          f"non-F32 tensors it can write byte-identically", flush=True)
    return record


def make_all(out: Path, llama_cpp_dir: Path, llama_python: str) -> list[dict]:
    hf_root = out / "hf"
    records = []
    jobs = [(f"tiny-{arch}", f"tiny-{arch}", build_tiny(hf_root, arch), ("f32",), TINY_QUANTS)
            for arch in ARCH_EXTRA]
    jobs.append((BUILTIN, BUILTIN, _builtin_dir(hf_root), ("f32", "f16"),
                 BUILTIN_QUANTS))
    for stem, name, hf_dir, outtypes, quants in jobs:
        for outtype in outtypes:
            convert(llama_cpp_dir, hf_dir, out / f"{stem}-{outtype.upper()}.gguf", outtype, name)
        for q in quants:
            dst = out / f"{stem}-{q}.gguf"
            fallbacks = quantize(llama_python, out / f"{stem}-F32.gguf", dst, q)
            if fallbacks:
                print(f"{dst.name}: llama.cpp fell back:\n{fallbacks}")
        for path in sorted(out.glob(f"{stem}-*.gguf")):
            records.append(dict(check(path, hf_dir, out / f"{stem}-F32.gguf", llama_python),
                                hf_dir=hf_dir.name))
    return records


def _builtin_dir(hf_root: Path) -> Path:
    """A copy of the built-in model's folder; the converter wants a folder named for it."""
    from carpool.default_model_path import DEFAULT_MODEL_DIR

    dst = hf_root / BUILTIN
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(DEFAULT_MODEL_DIR, dst)
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--llama-cpp-dir", required=True, type=Path,
                        help="llama.cpp's source tree (holds convert_hf_to_gguf.py)")
    parser.add_argument("--llama-python", required=True,
                        help="a Python with llama-cpp-python installed")
    parser.add_argument("--fixtures-dir", type=Path,
                        help="copy the COMMITTED files and a manifest here")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = make_all(out, args.llama_cpp_dir.resolve(), args.llama_python)
    (out / "manifest.json").write_text(json.dumps(records, indent=1))
    if args.fixtures_dir:
        args.fixtures_dir.mkdir(parents=True, exist_ok=True)
        kept = [r for r in records if r["file"] in COMMITTED]
        for r in kept:
            shutil.copyfile(out / r["file"], args.fixtures_dir / r["file"])
        (args.fixtures_dir / "manifest.json").write_text(json.dumps(kept, indent=1) + "\n")
        print(f"copied {len(kept)} files, {sum(r['bytes'] for r in kept)} bytes, "
              f"to {args.fixtures_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
