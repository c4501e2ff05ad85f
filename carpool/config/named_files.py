"""What a setting names outside the config: the model's folder (None: the built-in model),
its config.json and checkpoint format, a chat template file, a generation_config folder.

Apart from `EngineConfig` because these read files and resolve paths, where the config
itself only holds and checks values; `EngineConfig.from_args` calls them, and the engine
and server call them again for what the config names.
"""

from __future__ import annotations

import os

# Generation-config sources (vLLM's `--generation-config`), besides a folder.
GENERATION_CONFIG_AUTO = "auto"  # the model's generation_config.json
GENERATION_CONFIG_NONE = "vllm"  # none: SamplingParams' own defaults


def read_chat_template(value: str | None) -> str | None:
    """The template a `chat_template` argument names: a file's text, or the argument itself when
    it reads as a template (it holds `{` or a line break), as vLLM decides."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")


def check_generation_config(value: str) -> None:
    """ValueError unless `value` is auto, vllm, or a folder holding generation_config.json."""
    if value in (GENERATION_CONFIG_AUTO, GENERATION_CONFIG_NONE):
        return
    if not os.path.isfile(os.path.join(value, "generation_config.json")):
        raise ValueError(f"generation_config must be {GENERATION_CONFIG_AUTO!r}, "
                         f"{GENERATION_CONFIG_NONE!r} or a folder holding a "
                         f"generation_config.json, got {value!r}")


def generation_config_folder(value: str, model_path) -> str | None:
    """Where the sampling defaults of a `generation_config` setting live: the model's folder
    (auto), nowhere (vllm: None), or the folder given."""
    if value == GENERATION_CONFIG_AUTO:
        return str(model_path)
    return None if value == GENERATION_CONFIG_NONE else value


def load_model_config_of(model: str | None):
    """The model's `ModelConfig`, from its config.json (None: the built-in model)."""
    from carpool.models.config import load_model_config
    from carpool.models.paths import resolve_model_path

    return load_model_config(resolve_model_path(model_or_default(model)))


def check_quantization_of(model: str | None, quantization: str | None) -> None:
    """ValueError unless --quantization matches the model's checkpoint (None, auto: any)."""
    from carpool.models.paths import resolve_model_path
    from carpool.models.quant.hf_config import check_quantization

    check_quantization(resolve_model_path(model_or_default(model)), quantization)


def model_or_default(model: str | None) -> str:
    """`model`, or the built-in model's folder when None."""
    if model is not None:
        return model
    from carpool.default_model_path import default_model_path
    return str(default_model_path())
