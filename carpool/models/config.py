"""A checkpoint's `config.json` (+ `generation_config.json`) read into one frozen dataclass.

Only the fields the Llama-family network needs, each normalised once here so the
model code never looks at raw JSON. RoPE settings arrive in two spellings:
legacy (`rope_theta` at the top, `rope_scaling` dict with `type` or `rope_type`)
and newer (`rope_parameters` holding `rope_theta` and `rope_type`); both become
one `RopeConfig`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from carpool.models.moe_config import MoeConfig, parse_moe_config
from carpool.models.registry import get_architecture_spec

DEFAULT_ROPE_THETA = 10000.0
# RoPE types whose scaling needs the pretraining context length.
_NEEDS_ORIGINAL_LEN = ("llama3", "yarn")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"  # default | linear | llama3 | yarn
    rope_theta: float = DEFAULT_ROPE_THETA
    factor: float = 1.0  # linear, llama3, yarn: how far the context was stretched
    original_max_position_embeddings: int | None = None  # llama3, yarn: pretraining length
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: scales cos/sin; None derives it from factor
    mscale: float | None = None  # yarn (DeepSeek-style attention_factor)
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dims

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported RoPE type {self.rope_type!r}; "
                             f"supported: {SUPPORTED_ROPE_TYPES}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # e.g. "LlamaForCausalLM", a key of the registry
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads: == num_heads (MHA), fewer (GQA), 1 (MQA)
    head_dim: int  # may differ from hidden_size // num_heads (Qwen3)
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    dtype: str  # the checkpoint's torch dtype name, e.g. "bfloat16"
    eos_token_ids: tuple[int, ...]  # generation_config.json first, then config.json
    bos_token_id: int | None
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2)
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool  # RMSNorm over each head of q and k before RoPE (Qwen3)
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_window: int | None = None  # attend to at most this many most recent keys
    moe: MoeConfig | None = None  # the experts of a mixture-of-experts model; None: dense

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")


def load_model_config(path: Path) -> ModelConfig:
    """Read `path/config.json` (and `generation_config.json` if present) into a ModelConfig;
    a `.gguf` file's metadata instead where `path` is one.

    Raises FileNotFoundError naming a missing config.json, ValueError naming an
    unsupported architecture or a bad field.
    """
    path = Path(path)
    if path.suffix.lower() == ".gguf" and path.is_file():
        from carpool.models.quant.gguf_file import GgufFile  # the gguf reader, only for these
        return GgufFile(path).model_config()
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"config.json not found in model folder {path}")
    raw = json.loads(config_file.read_text())
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ValueError(f"{config_file} names no 'architectures'")
    spec = get_architecture_spec(architectures[0])
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r} (only 'silu')")
    hidden_size = _require(raw, "hidden_size")
    num_heads = _require(raw, "num_attention_heads")
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    qkv_bias, o_proj_bias, mlp_bias = spec.biases(raw)
    num_layers = _require(raw, "num_hidden_layers")
    return ModelConfig(
        architecture=architectures[0],
        vocab_size=_require(raw, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=_require(raw, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        max_position_embeddings=_require(raw, "max_position_embeddings"),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        eos_token_ids=_eos_token_ids(path, raw),
        bos_token_id=raw.get("bos_token_id"),
        qkv_bias=qkv_bias,
        o_proj_bias=o_proj_bias,
        mlp_bias=mlp_bias,
        qk_norm=spec.qk_norm,
        rope=parse_rope_config(raw),
        sliding_window=_sliding_window(raw),
        moe=None if spec.moe is None else parse_moe_config(raw, spec.moe, num_layers),
    )


def parse_rope_config(raw: dict) -> RopeConfig:
    """Both spellings -> RopeConfig. `rope_parameters` wins over `rope_scaling` when both exist."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor {partial} is not supported (only 1.0)")
    theta = params.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA))
    original = params.get("original_max_position_embeddings",
                          raw.get("original_max_position_embeddings"))
    if rope_type in _NEEDS_ORIGINAL_LEN and original is None:
        original = raw.get("max_position_embeddings")  # as transformers does
    if rope_type != "default" and "factor" not in params:
        raise ValueError(f"RoPE scaling {rope_type!r} needs a 'factor'")
    known = {f: params[f] for f in ("low_freq_factor", "high_freq_factor", "attention_factor",
                                    "mscale", "mscale_all_dim", "truncate") if f in params}
    for name in ("beta_fast", "beta_slow"):
        if params.get(name):
            known[name] = float(params[name])
    return RopeConfig(rope_type=rope_type, rope_theta=float(theta),
                      factor=float(params.get("factor") or 1.0),
                      original_max_position_embeddings=original, **known)


def _eos_token_ids(path: Path, raw: dict) -> tuple[int, ...]:
    gen_file = path / "generation_config.json"
    value = None
    if gen_file.is_file():
        value = json.loads(gen_file.read_text()).get("eos_token_id")
    if value is None:
        value = raw.get("eos_token_id")
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _sliding_window(raw: dict) -> int | None:
    if raw.get("use_sliding_window") is False:  # Qwen2 stores a window it does not use
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None


def _require(raw: dict, name: str):
    if name not in raw:
        raise ValueError(f"config.json is missing required field {name!r}")
    return raw[name]
