"""Pick the device and dtype a model runs in, from "auto" or an explicit name."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16",
            "bf16": "bfloat16"}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" -> cuda if available, else cpu. An unavailable CUDA device raises naming it."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} requested but CUDA is not available")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {str(device)!r} (cpu or cuda)")
    return resolved


def native_bfloat16(device: torch.device) -> bool:
    """Whether `device` computes bfloat16 in hardware: a CUDA card that supports it, or a
    CPU with AVX512-BF16 or AMX tiles (elsewhere bfloat16 on CPU is emulated and slower
    than float32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_dtype(dtype: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """"auto" takes the checkpoint's dtype, as vLLM does, except: a float32 checkpoint runs
    in bfloat16 where the device computes bfloat16 natively (CUDA without it: float16), and
    a float16 checkpoint on CPU runs in float32 (half-precision matmuls are slow there).
    `--dtype float32` keeps a float32 checkpoint exact."""
    if dtype == "auto":
        name = _ALIASES.get(checkpoint_dtype, checkpoint_dtype)
        if name not in _DTYPES:
            logger.warning("checkpoint dtype %r unknown; using float32", checkpoint_dtype)
            name = "float32"
        native = name == "float32" and native_bfloat16(device)
        if native or (name == "float32" and device.type == "cuda"):
            name = "bfloat16" if native else "float16"
            logger.info("dtype auto: the float32 checkpoint runs in %s on %s (as vLLM's auto "
                        "does); --dtype float32 keeps float32", name, device.type)
        elif name == "float16" and device.type == "cpu":
            logger.warning("float16 checkpoint on CPU: running in float32 "
                           "(half-precision matmuls are slow or missing on CPU)")
            name = "float32"
        return _DTYPES[name]
    name = _ALIASES.get(dtype, dtype)
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[name]


def device_for_rank(device: torch.device, rank: int) -> torch.device:
    """A tensor-parallel rank's device: CUDA rank r takes card r of this machine, or card
    k + r when the device names card k (a data-parallel replica's ranks start at its first
    card); CPU is CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", ((device.index or 0) + rank) % torch.cuda.device_count())
