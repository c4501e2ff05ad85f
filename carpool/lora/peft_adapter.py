"""A LoRA adapter as PEFT writes it (`adapter_config.json` + `adapter_model.safetensors`),
checked against the base model and laid out for carpool's stacked linears.

PEFT's tensor `...layers.{i}.self_attn.q_proj.lora_A.weight` is A [r, in] and `lora_B` is
B [out, r]; the layer adds x·Aᵀ·Bᵀ·scale with scale = lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)). carpool runs q/k/v as one `qkv_proj` and gate/up as one
`gate_up_proj` (`models/llama.py`), so an adapter's parts of one stacked linear share one
A (their A's side by side) and each part's B lands in its own output columns: one small
matmul for the shared input, one per part for the output, and no zero blocks stored, so a
loaded adapter holds what its file holds (in the model's dtype).

Anything the layers cannot apply is refused by name before a request runs: DoRA, a
trained bias, `modules_to_save`, fan-in/fan-out weights, per-module rank or alpha patterns,
target modules outside q/k/v/o/gate/up/down (and the fused qkv_proj / gate_up_proj), a rank
above `max_lora_rank`, and shapes or layers the base model does not have.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from carpool.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# carpool's linear -> its checkpoint parts, in output-column order
STACKED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
           "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
FUSED = {"qkv_proj": "qkv", "gate_up_proj": "gate_up"}  # PEFT names of already-fused linears
_MODULE_OF = {part: module for module, parts in STACKED.items() for part in parts}
_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                     r"(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of `adapter_config.json` that change what the layers compute."""

    rank: int
    alpha: float
    use_rslora: bool

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True)
class ModuleLora:
    """One stacked linear's adapter term: out[:, cols] += (x @ a)[:, ranks] @ b per part."""

    a: torch.Tensor  # [in_features, sum of the parts' ranks]
    # (first column, last column + 1, first rank, last rank + 1, B·scale [rank, columns])
    parts: tuple[tuple[int, int, int, int, torch.Tensor], ...]


@dataclass(frozen=True)
class LoraWeights:
    """A loaded adapter: per layer, the carpool linears it changes."""

    name: str
    layers: tuple[dict[str, ModuleLora], ...]
    nbytes: int


def read_adapter_config(folder: Path, max_lora_rank: int) -> AdapterConfig:
    """`adapter_config.json`, refusing (ValueError naming the field) what carpool cannot
    apply."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"LoRA adapter {str(folder)!r} has no {CONFIG_FILE}")
    raw = json.loads(path.read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {str(folder)!r}: peft_type {raw['peft_type']!r} is not "
                         "supported (only LORA)")
    refused = {"use_dora": bool(raw.get("use_dora")),
               "bias": raw.get("bias", "none") not in (None, "none"),
               "modules_to_save": bool(raw.get("modules_to_save")),
               "fan_in_fan_out": bool(raw.get("fan_in_fan_out")),
               "rank_pattern": bool(raw.get("rank_pattern")),
               "alpha_pattern": bool(raw.get("alpha_pattern")),
               "use_qalora": bool(raw.get("use_qalora")),
               "lora_bias": bool(raw.get("lora_bias"))}
    for field, bad in refused.items():
        if bad:
            raise ValueError(f"LoRA adapter {str(folder)!r}: {field}={raw[field]!r} is not "
                             "supported")
    targets = raw.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets] if targets in _MODULE_OF or targets in FUSED else []
    unknown = [t for t in targets if t not in _MODULE_OF and t not in FUSED]
    if unknown:
        raise ValueError(f"LoRA adapter {str(folder)!r}: target_modules {unknown} are not "
                         "supported (q/k/v/o/gate/up/down_proj, qkv_proj, gate_up_proj)")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {str(folder)!r}: r must be an integer >= 1, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {str(folder)!r} has rank {rank}, above max_lora_rank "
                         f"({max_lora_rank})")
    return AdapterConfig(rank, float(alpha), bool(raw.get("use_rslora")))


def part_sizes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Checkpoint linear -> (in_features, out_features) of the base model."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inner), "up_proj": (hidden, inner),
            "down_proj": (inner, hidden), "qkv_proj": (hidden, q + 2 * kv),
            "gate_up_proj": (hidden, 2 * inner)}


def read_tensors(folder: Path, config: ModelConfig, adapter: AdapterConfig,
                 load: bool) -> dict[tuple[int, str], dict[str, torch.Tensor | tuple]]:
    """(layer, checkpoint linear) -> {"A": ..., "B": ...}: tensors (`load`) or their shapes,
    checked against the base model's layers and shapes."""
    from safetensors import safe_open

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(f"LoRA adapter {str(folder)!r} has no {WEIGHTS_FILE}")
    sizes = part_sizes(config)
    found: dict[tuple[int, str], dict] = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            match = _TENSOR.match(key)
            if match is None:
                raise ValueError(f"LoRA adapter {str(folder)!r}: tensor {key!r} is not a "
                                 "q/k/v/o/gate/up/down LoRA weight of a decoder layer")
            layer, linear, kind = int(match[1]), match[2], match[3]
            if linear not in sizes:
                raise ValueError(f"LoRA adapter {str(folder)!r}: module {linear!r} ({key}) "
                                 "is not supported")
            if layer >= config.num_layers:
                raise ValueError(f"LoRA adapter {str(folder)!r}: {key} is for layer {layer}, "
                                 f"the base model has {config.num_layers} layers")
            shape = tuple(f.get_slice(key).get_shape())
            in_features, out_features = sizes[linear]
            want = (adapter.rank, in_features) if kind == "A" else (out_features, adapter.rank)
            if shape != want:
                raise ValueError(f"LoRA adapter {str(folder)!r}: {key} has shape {list(shape)}, "
                                 f"the base model needs {list(want)}: not an adapter of this "
                                 "model")
            found.setdefault((layer, linear), {})[kind] = f.get_tensor(key) if load else shape
    for (layer, linear), pair in found.items():
        if len(pair) != 2:
            raise ValueError(f"LoRA adapter {str(folder)!r}: layer {layer} {linear} has "
                             f"lora_{'B' if 'A' in pair else 'A'} missing")
    if not found:
        raise ValueError(f"LoRA adapter {str(folder)!r} holds no LoRA weights")
    return found


def check_adapter(folder: str | Path, config: ModelConfig, max_lora_rank: int) -> AdapterConfig:
    """ValueError naming what makes the folder no adapter of this base model (reads the
    config and the tensors' shapes, not their data)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter folder {str(folder)!r} does not exist")
    adapter = read_adapter_config(folder, max_lora_rank)
    read_tensors(folder, config, adapter, load=False)
    return adapter


def load_adapter(name: str, folder: str | Path, config: ModelConfig, max_lora_rank: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> LoraWeights:
    """The adapter's weights, checked, in carpool's stacked layout and the model's dtype."""
    folder = Path(folder)
    adapter = check_adapter(folder, config, max_lora_rank)
    tensors = read_tensors(folder, config, adapter, load=True)
    sizes = part_sizes(config)
    layers: list[dict[str, ModuleLora]] = [{} for _ in range(config.num_layers)]
    nbytes = 0
    for layer in range(config.num_layers):
        for module, parts in STACKED.items():
            fused = next((n for n, m in FUSED.items() if m == module), None)
            if fused is not None and (layer, fused) in tensors:
                present = [(fused, 0)]
            else:
                present, column = [], 0
                for part in parts:
                    if (layer, part) in tensors:
                        present.append((part, column))
                    column += sizes[part][1]
            if not present:
                continue
            a_blocks, out_parts, rank_start = [], [], 0
            for part, column in present:
                pair = tensors[(layer, part)]
                a = pair["A"].to(device=device, dtype=dtype).t()
                b = (pair["B"].float() * adapter.scale).to(device=device, dtype=dtype).t()
                b = b.contiguous()
                a_blocks.append(a)
                out_parts.append((column, column + b.shape[1], rank_start,
                                  rank_start + adapter.rank, b))
                rank_start += adapter.rank
                nbytes += b.numel() * b.element_size()
            a = torch.cat(a_blocks, dim=1).contiguous()
            nbytes += a.numel() * a.element_size()
            layers[layer][module] = ModuleLora(a, tuple(out_parts))
    return LoraWeights(name, tuple(layers), nbytes)
