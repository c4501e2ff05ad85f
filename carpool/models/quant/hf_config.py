"""Hugging Face quantized checkpoints: which scheme a `config.json`'s `quantization_config`
names (`detect_scheme`, from `quant_method` as vLLM reads it), checked against --quantization
(`check_quantization`). Settings carpool cannot run are refused naming the field.

Read while the engine's config resolves, before the port is bound, so no torch here: the
conversions of each scheme's tensors live in `hf_formats`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# --quantization's values (vLLM's names); None or "auto" detects.
QUANTIZATION_METHODS = ("awq", "gptq", "compressed-tensors", "gguf")
FIELD = "quantization_config"


@dataclass(frozen=True)
class HfScheme:
    """One checkpoint's quantization: how to find and convert each quantized linear."""

    method: str  # "awq", "gptq" or "compressed-tensors"
    layout: str  # "awq", "gptq", "ct-packed" or "ct-int"
    bits: int
    group_size: int | None  # None: one group per row (per channel or per tensor)
    symmetric: bool
    zero_offset: int = 0  # GPTQ "gptq" format: stored zeros are z - 1
    input_int8: bool = False  # W8A8: activations int8 per token, dynamic scales

    @property
    def marker(self) -> str:
        """The tensor suffix whose presence says a linear is quantized."""
        return {"awq": "qweight", "gptq": "qweight", "ct-packed": "weight_packed",
                "ct-int": "weight_scale"}[self.layout]

    @property
    def suffixes(self) -> tuple[str, ...]:
        """Every tensor suffix a quantized linear may hold (besides its bias)."""
        return {"awq": ("qweight", "qzeros", "scales"),
                "gptq": ("qweight", "qzeros", "scales", "g_idx"),
                "ct-packed": ("weight_packed", "weight_scale", "weight_shape",
                              "weight_zero_point"),
                "ct-int": ("weight", "weight_scale", "weight_zero_point")}[self.layout]

    def describe(self) -> str:
        group = "per channel" if self.group_size is None else f"group {self.group_size}"
        acts = ", int8 activations per token" if self.input_int8 else ""
        sym = "symmetric" if self.symmetric else "asymmetric"
        return f"{self.method} int{self.bits} {sym} {group}{acts}"


def check_quantization(path: str | Path, quantization: str | None) -> HfScheme | None:
    """The scheme the checkpoint at `path` is quantized with (None: float, or a GGUF file),
    checked against --quantization (None / "auto": whatever the checkpoint says)."""
    path = Path(path)
    if quantization not in (None, "auto", *QUANTIZATION_METHODS):
        raise ValueError(f"--quantization must be one of {QUANTIZATION_METHODS} or auto, "
                         f"got {quantization!r}")
    if path.suffix.lower() == ".gguf":
        if quantization not in (None, "auto", "gguf"):
            raise ValueError(f"--quantization {quantization} does not match {path.name}, a "
                             f"GGUF file (--quantization gguf, or leave it out)")
        return None
    if quantization == "gguf":
        raise ValueError(f"--quantization gguf needs a .gguf file, got the folder {path}")
    config_file = path / "config.json"
    raw = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config = raw.get(FIELD)
    if config is None:
        if quantization not in (None, "auto"):
            raise ValueError(f"--quantization {quantization}: {config_file} has no {FIELD} "
                             f"(a float checkpoint; leave --quantization out)")
        return None
    scheme = detect_scheme(config)
    if quantization not in (None, "auto") and quantization != scheme.method:
        raise ValueError(f"--quantization {quantization} does not match the checkpoint's "
                         f"{FIELD}.quant_method {scheme.method!r}")
    return scheme


def detect_scheme(config: dict) -> HfScheme:
    """A `quantization_config` -> its scheme; a ValueError naming the field it cannot run."""
    method = str(config.get("quant_method", "")).lower()
    detect = {"awq": _awq_scheme, "gptq": _gptq_scheme,
              "compressed-tensors": _compressed_tensors_scheme}.get(method)
    if detect is None:
        raise ValueError(f"{FIELD}.quant_method {method!r} is not supported (supported: awq, "
                         f"gptq, compressed-tensors; GGUF files load as they are)")
    return detect(config)


def _refuse(field: str, value, why: str):
    raise ValueError(f"{FIELD}.{field} = {value!r} is not supported: {why}")


def _group_size(field: str, value, bits: int) -> int | None:
    """A group size field: -1 / None per channel, else a positive multiple of 32 for 4 bits."""
    if value in (None, -1, 0):
        return None
    if not isinstance(value, int) or value < 1 or (bits == 4 and value % 32):
        _refuse(field, value, "group size must be -1 (per channel) or a positive integer"
                + (", a multiple of 32 for 4 bits" if bits == 4 else ""))
    return value


def _awq_scheme(config: dict) -> HfScheme:
    bits = config.get("bits", config.get("w_bit", 4))
    if bits != 4:
        _refuse("bits", bits, "AWQ checkpoints are 4-bit")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        _refuse("version", config.get("version"), "only AWQ's GEMM packing is read (GEMV and "
                "the kernel-specific layouts pack differently)")
    key = "group_size" if "group_size" in config else "q_group_size"
    group = _group_size(key, config.get(key, 128), 4)
    # zero_point false: symmetric, the fixed zero 8 (vLLM's uint4b8), qzeros not read
    return HfScheme("awq", "awq", 4, group, symmetric=not config.get("zero_point", True))


def _gptq_scheme(config: dict) -> HfScheme:
    bits = config.get("bits")
    if bits not in (4, 8):
        _refuse("bits", bits, "GPTQ weights of 4 or 8 bits")
    if config.get("dynamic"):
        _refuse("dynamic", config["dynamic"], "per-module overrides of the scheme")
    key = "checkpoint_format" if "checkpoint_format" in config else "format"
    fmt = str(config.get(key) or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        _refuse(key, config.get(key), "only the gptq and gptq_v2 packings are read")
    group = _group_size("group_size", config.get("group_size", 128), bits)
    symmetric = bool(config.get("sym", True))
    return HfScheme("gptq", "gptq", bits, group, symmetric,
                    zero_offset=1 if fmt == "gptq" else 0)


def _compressed_tensors_scheme(config: dict) -> HfScheme:
    for field in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        value = config.get(field)
        if value and (field != "sparsity_config" or value.get("format") != "dense"):
            _refuse(field, value, "only weight (and activation) quantization")
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        _refuse("config_groups", sorted(groups), "exactly one quantization group")
    name, group = next(iter(groups.items()))
    where = f"config_groups.{name}"
    if "Linear" not in (group.get("targets") or []):
        _refuse(f"{where}.targets", group.get("targets"), "the group must target Linear")
    weights = group.get("weights") or {}
    bits = weights.get("num_bits")
    if weights.get("type", "int") != "int":
        _refuse(f"{where}.weights.type", weights.get("type"), "only integer weights")
    if bits not in (4, 8):
        _refuse(f"{where}.weights.num_bits", bits, "4- or 8-bit weights")
    if weights.get("dynamic"):
        _refuse(f"{where}.weights.dynamic", weights["dynamic"], "weights with stored scales")
    if weights.get("actorder") not in (None, "static", "weight", False):
        _refuse(f"{where}.weights.actorder", weights["actorder"],
                "activation ordering with a stored g_idx")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "group", "tensor"):
        _refuse(f"{where}.weights.strategy", strategy, "channel, group or tensor scales")
    group_size = (_group_size(f"{where}.weights.group_size", weights.get("group_size"), bits)
                  if strategy == "group" else None)
    fmt_field = f"{where}.format" if group.get("format") else "format"
    fmt = group.get("format") or config.get("format")
    if fmt == "pack-quantized":
        layout = "ct-packed"
    elif fmt in ("int-quantized", "naive-quantized") and bits == 8:
        layout = "ct-int"
    else:
        _refuse(fmt_field, fmt, f"int{bits} weights are read from pack-quantized"
                + (" or int-quantized" if bits == 8 else "") + " checkpoints")
    if group.get("output_activations"):
        _refuse(f"{where}.output_activations", group["output_activations"],
                "quantized outputs")
    acts = group.get("input_activations")
    input_int8 = acts is not None
    if acts is not None:
        wanted = {"type": "int", "num_bits": 8, "symmetric": True, "strategy": "token",
                  "dynamic": True}
        for key, value in wanted.items():
            if acts.get(key) != value:
                _refuse(f"{where}.input_activations.{key}", acts.get(key),
                        "activations are run as symmetric int8 with dynamic per-token "
                        "scales only")
    return HfScheme("compressed-tensors", layout, bits, group_size,
                    bool(weights.get("symmetric", True)), input_int8=input_int8)
