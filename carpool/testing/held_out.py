"""The built-in model's held-out text and the mean negative log-likelihood a model gives it,
for tests and benchmarks that ask whether quantized weights keep the model's quality.

The held-out documents are those `scripts/train_default_model.py` set aside (one stdlib file in
20, by hash), tokenized and windowed as it does. The NLL is read from prompt logprobs, the
way a user of the server would measure it.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_default_model.py"


def _training_script():
    spec = importlib.util.spec_from_file_location("train_default_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def held_out_windows(tokenizer, num_windows: int, length: int = 511) -> list[list[int]]:
    """The first `num_windows` non-overlapping windows of `length` token ids of the held-out
    documents (each document followed by <|endoftext|>), tokenized by `tokenizer`: the windows
    llama.cpp's figures were taken on (`benchmarks/quant/heldout_tokens.py`, lab 51)."""
    script = _training_script()
    _, held_out = script.corpus_split()
    stream = script.token_stream(tokenizer, held_out).tolist()
    return [stream[i * length:(i + 1) * length] for i in range(num_windows)]


def mean_prompt_nll(llm, windows: list[list[int]]) -> float:
    """Mean negative log-likelihood (nats per token) of every token of `windows` after the
    first, from the engine's prompt logprobs."""
    from carpool import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    total, count = 0.0, 0
    for window, out in zip(windows, outs):
        for token, position in zip(window[1:], out.prompt_logprobs[1:]):
            total -= position[token].logprob
            count += 1
    return total / count if count else math.nan
