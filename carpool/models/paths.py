"""Find a checkpoint: a local folder, or a Hugging Face hub id fetched into the hub cache.

No torch here: the config builder resolves the model and reads its config.json
before anything heavy is imported (so `carpool serve` binds its port at once).
"""

from __future__ import annotations

import os
from pathlib import Path


def resolve_model_path(model: str | os.PathLike) -> Path:
    """A local folder as is; otherwise a hub id fetched with huggingface_hub (cache first).

    Honours HF_HUB_OFFLINE. Raises FileNotFoundError naming what is missing.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json")
        return path
    if path.exists():
        raise FileNotFoundError(f"model path {path} is not a folder")
    if str(model).startswith((".", "/", "~")) or str(model).count("/") > 1:
        raise FileNotFoundError(f"model folder {path} does not exist")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id=str(model), allow_patterns=[
            "*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model", "*.txt"])
    except Exception as exc:  # offline, unknown repo, gated, no network
        raise FileNotFoundError(
            f"model {model!r} is neither a local folder nor a downloadable hub id "
            f"(with HF_HUB_OFFLINE=1 only the local cache is searched): {exc}") from exc
    return Path(local)
