"""Attention backends: how keys and values are written to the paged cache and attended.

A backend builds its per-step metadata once, from the step's packed layout, and
every layer reads it unchanged. `cpu` holds the CPU-specific fast paths; `sdpa`
is portable PyTorch and what CUDA runs. A backend's module is imported only
when it is chosen.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from carpool.attention.base import AttentionBackend, AttentionShape, StepLayout

__all__ = ["BACKEND_NAMES", "AttentionBackend", "AttentionShape", "StepLayout",
           "create_backend", "resolve_backend_name"]

# name -> "module:class"
_REGISTRY = {"cpu": "carpool.attention.cpu:CpuBackend",
             "sdpa": "carpool.attention.sdpa:SdpaBackend"}
BACKEND_NAMES = ("auto", *_REGISTRY)  # what `attention_backend` may be
_DEVICE_TYPES = {"cpu": ("cpu",), "sdpa": ("cpu", "cuda")}


def resolve_backend_name(name: str, device_type: str) -> str:
    """"auto" -> cpu on CPU, sdpa elsewhere; ValueError for a name that can't run there."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "auto":
        return "cpu" if device_type == "cpu" else "sdpa"
    if device_type not in _DEVICE_TYPES[name]:
        raise ValueError(f"attention_backend {name!r} does not run on {device_type} "
                         f"(it runs on {', '.join(_DEVICE_TYPES[name])})")
    return name


def create_backend(name: str, shape: AttentionShape, device: torch.device,
                   kernels: ModuleType | None = None,
                   batch_invariant: bool = False) -> AttentionBackend:
    """The backend `name` ("auto" resolved for `device`), built for layers of `shape`, using
    the compiled `kernels` where it has a use for them. `batch_invariant` asks for one fixed
    reduction order per query row whatever the step holds: only the cpu backend with the
    kernels offers it (ValueError otherwise)."""
    resolved = resolve_backend_name(name, device.type)
    module_name, _, class_name = _REGISTRY[resolved].partition(":")
    backend_cls = getattr(importlib.import_module(module_name), class_name)
    if not batch_invariant:
        return backend_cls(shape, device, kernels)
    if resolved != "cpu" or kernels is None:
        raise ValueError(f"batch_invariant needs the cpu attention backend with the C++ "
                         f"kernels (got {resolved!r}, kernels "
                         f"{'on' if kernels is not None else 'off'})")
    return backend_cls(shape, device, kernels, batch_invariant=True)
