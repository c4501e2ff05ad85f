"""Sampling defaults a checkpoint ships in `generation_config.json`.

Hugging Face `generate` applies them, and so does vLLM (its default
`--generation-config auto`): a field the request leaves unset takes the
model's value, e.g. Qwen2.5-Instruct's `repetition_penalty: 1.05`. carpool
does the same, so a checkpoint behaves as its authors tuned it.
"""

from __future__ import annotations

import json
from pathlib import Path

# The generation_config.json keys that map to SamplingParams fields of the same name.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_sampling_defaults(model_path: str | Path) -> dict[str, float | int]:
    """{field: value} for the SAMPLING_KEYS the checkpoint sets (empty without the file)."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    with open(path) as f:
        config = json.load(f)
    return {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
