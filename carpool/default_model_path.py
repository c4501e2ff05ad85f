"""Where the built-in default model lives, so `carpool serve` and `LLM()` work offline.

The package ships a tiny Llama trained on Python's standard library by
`scripts/train_default_model.py`; it is an ordinary Hugging Face folder and loads
through the same code as any user checkpoint.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"
# What clients call the built-in model (its folder path is no name to type); as a model
# argument it names the built-in model too, so a launch line may repeat the served name.
DEFAULT_MODEL_NAME = "carpool-default"


def default_model_path() -> Path:
    """The shipped model folder; raises if the package was installed without it."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the built-in default model is missing from {DEFAULT_MODEL_DIR}; reinstall "
            "carpool or run scripts/train_default_model.py, or pass a model explicitly")
    return DEFAULT_MODEL_DIR
