"""Held-out token windows on which llama.cpp's and carpool's NLL of the built-in model compare.

The built-in model (carpool/default_model) was trained on the Python standard
library with one file in 20 held out by path hash (scripts/train_default_model.py).
This takes that same held-out token stream (every held-out file cut into documents,
each followed by `<|endoftext|>`, tokenized by the built-in model's tokenizer) and
cuts its start into NUM_WINDOWS contiguous, non-overlapping windows of WINDOW
tokens. A window is one prompt: its NLL is the mean over positions 1..WINDOW-1 of
-log p(token | the tokens before it in the window). WINDOW is 511 so one window
plus one generated token fits the model's 512-token context, as a prompt with
prompt logprobs must in carpool. The stream depends on the Python minor version
(3.11 for the model), so the file records it and a digest of the ids.

    python3 -m benchmarks.quant.heldout_tokens /tmp/heldout.json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 511
NUM_WINDOWS = 16


def _training_script():
    spec = importlib.util.spec_from_file_location(
        "train_default_model", ROOT / "scripts" / "train_default_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def heldout_windows(window: int = WINDOW,
                    num_windows: int = NUM_WINDOWS) -> tuple[list[list[int]], list[str]]:
    """The first `num_windows` windows of `window` ids of the built-in model's held-out stream,
    and the documents whose ids (each followed by `<|endoftext|>`) make up those windows."""
    import transformers

    from carpool.default_model_path import DEFAULT_MODEL_DIR

    training = _training_script()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    _, heldout_files = training.corpus_split()
    stream = training.token_stream(tokenizer, heldout_files).tolist()
    if len(stream) < window * num_windows:
        raise ValueError(f"held-out stream has {len(stream)} tokens, "
                         f"fewer than {num_windows} windows of {window}")
    docs, covered = [], 0
    for f in heldout_files:
        for doc in training.documents(f.read_text(encoding="utf-8")):
            if covered >= window * num_windows:
                break
            docs.append(doc)
            covered += len(tokenizer(doc, add_special_tokens=False).input_ids) + 1
    return [stream[i * window:(i + 1) * window] for i in range(num_windows)], docs


def ids_digest(windows: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(windows).encode()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON file to write")
    parser.add_argument("--window", type=int, default=WINDOW)
    parser.add_argument("--num-windows", type=int, default=NUM_WINDOWS)
    args = parser.parse_args(argv)
    windows, documents = heldout_windows(args.window, args.num_windows)
    record = {"python": platform.python_version(), "window": args.window,
              "num_windows": args.num_windows, "sha256": ids_digest(windows),
              "windows": windows, "documents": documents}
    Path(args.out).write_text(json.dumps(record))
    print(f"wrote {args.out}: {args.num_windows} windows of {args.window} ids, "
          f"sha256 {record['sha256'][:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
