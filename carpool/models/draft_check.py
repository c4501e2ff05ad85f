"""Whether a checkpoint can draft for another (speculative method `draft_model`), read from
their config.json and tokenizer.json before any weights load.

A draft proposes token ids that the target verifies, so both must mean the same thing by
every id: the same vocabulary size and, where both folders hold a tokenizer.json, the same
vocabulary and added tokens. What carpool's draft path does not run is refused by name
rather than half run: a mixture-of-experts draft, a quantized or GGUF draft, a draft whose
positions stop short of max_model_len. No torch here.
"""

from __future__ import annotations

import json
from pathlib import Path

from carpool.models.config import ModelConfig, load_model_config
from carpool.models.paths import resolve_model_path

FIELD = "speculative_config.model"


def check_draft_model(draft: str, target: ModelConfig, target_path: Path,
                      max_model_len: int) -> ModelConfig:
    """The draft's `ModelConfig`; ValueError naming `speculative_config.model` and the field
    that differs, or what is not supported."""
    try:
        path = resolve_model_path(draft)
    except FileNotFoundError as exc:
        raise ValueError(f"{FIELD}: {exc}") from None
    if path.suffix.lower() == ".gguf":
        raise ValueError(f"{FIELD}: a GGUF draft ({path.name}) is not supported; give a "
                         "safetensors folder")
    config = load_model_config(path)
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"{FIELD}: the draft's vocab_size ({config.vocab_size}) differs from "
                         f"the target's ({target.vocab_size}); a draft needs the target's "
                         "tokenizer")
    if config.moe is not None:
        raise ValueError(f"{FIELD}: a mixture-of-experts draft ({config.architecture}) is "
                         "not supported; give a dense model")
    raw = json.loads((path / "config.json").read_text())
    if raw.get("quantization_config") is not None:
        raise ValueError(f"{FIELD}: a quantized draft is not supported; give a float "
                         "checkpoint")
    if config.max_position_embeddings < max_model_len:
        raise ValueError(f"{FIELD}: the draft's max_position_embeddings "
                         f"({config.max_position_embeddings}) is below max_model_len "
                         f"({max_model_len})")
    if target_path.is_dir():
        draft_vocab, target_vocab = _vocabulary(path), _vocabulary(target_path)
        if draft_vocab is not None and target_vocab is not None and draft_vocab != target_vocab:
            raise ValueError(f"{FIELD}: the draft's tokenizer.json (vocab, added_tokens) "
                             "differs from the target's; a draft needs the target's tokenizer")
    return config


def _vocabulary(folder: Path) -> tuple | None:
    """(token -> id, added tokens) of the folder's tokenizer.json; None without one."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    data = json.loads(file.read_text())
    vocab = (data.get("model") or {}).get("vocab")
    added = [(t.get("id"), t.get("content")) for t in data.get("added_tokens") or ()]
    return (vocab if isinstance(vocab, dict) else json.dumps(vocab, sort_keys=True),
            sorted(added, key=repr))


def weight_bytes(path: Path) -> int:
    """The bytes of a checkpoint's weights: a GGUF file's size, or its safetensors files'."""
    if path.is_file():
        return path.stat().st_size
    return sum(file.stat().st_size for file in path.glob("*.safetensors"))


def estimated_pass_cost(draft: str, target_path: Path) -> float:
    """One draft pass as a share of a target decode step: the draft's weight bytes over the
    target's (a decode on the CPU is bound by reading its weights; host work per pass, which
    dominates tiny models, is not counted)."""
    target = weight_bytes(target_path)
    return weight_bytes(resolve_model_path(draft)) / target if target else 0.0

