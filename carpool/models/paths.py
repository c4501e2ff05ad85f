"""Find a checkpoint: a local folder, or a Hugging Face hub id fetched into the hub cache.

No torch here: the config builder resolves the model and reads its config.json
before anything heavy is imported (so `carpool serve` binds its port at once).
"""

from __future__ import annotations

import os
from pathlib import Path

from carpool.default_model_path import DEFAULT_MODEL_NAME, default_model_path


def resolve_model_path(model: str | os.PathLike) -> Path:
    """A local folder or GGUF file as is; the built-in model for its served name
    (`carpool-default`, unless a folder has that name); otherwise a hub id fetched with
    huggingface_hub (cache first).

    Honours HF_HUB_OFFLINE. Raises FileNotFoundError naming what is missing.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json")
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.exists():
        raise FileNotFoundError(f"model path {path} is neither a folder nor a .gguf file")
    if str(model) == DEFAULT_MODEL_NAME:
        return default_model_path()
    if str(model).startswith((".", "/", "~")) or str(model).count("/") > 1:
        raise FileNotFoundError(f"model folder {path} does not exist")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id=str(model), allow_patterns=[
            "*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model", "*.txt"])
    except Exception as exc:  # offline, unknown repo, gated, no network
        # Name HF_HUB_OFFLINE only when it is what kept the hub out of the search.
        offline = ("; HF_HUB_OFFLINE is set, so only the local hub cache was searched"
                   if _hub_offline() else "")
        raise FileNotFoundError(
            f"model {model!r} is neither a local folder nor a downloadable hub id{offline} "
            f"(the built-in model is {DEFAULT_MODEL_NAME!r}): {exc}") from exc
    return Path(local)


def _hub_offline() -> bool:
    """Whether huggingface_hub runs offline (its HF_HUB_OFFLINE, read by the library itself:
    carpool's engine layers never read the environment)."""
    from huggingface_hub import constants

    return constants.is_offline_mode()
