"""Attention backends: how keys and values are written to the paged cache and attended.

A backend builds its per-step metadata once, from the step's packed layout, and
every layer reads it unchanged; each backend has one metadata shape. The name `cpu`
resolves to one of two backends, as the attention route decides (`paths.decide_attention`,
part of the CPU platform's route): `cpu_kernel` (the compiled kernels) or
`cpu_torch` (PyTorch paths); `sdpa` is portable PyTorch and what CUDA runs. A backend's
module is imported only when it is chosen.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from carpool.attention.base import AttentionBackend, AttentionShape, StepLayout
from carpool.attention.paths import AttentionRoute, decide_attention

__all__ = ["BACKEND_NAMES", "AttentionBackend", "AttentionShape", "StepLayout",
           "create_backend", "resolve_backend_name"]

# what `attention_backend` may be; "cpu" is one of the two cpu-* backends below, by the route
BACKEND_NAMES = ("auto", "cpu", "sdpa")
# backend -> "module:class"
_REGISTRY = {"cpu-kernel": "carpool.attention.cpu_kernel:CpuKernelBackend",
             "cpu-torch": "carpool.attention.cpu_torch:CpuTorchBackend",
             "sdpa": "carpool.attention.sdpa:SdpaBackend"}
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
                   kernels: ModuleType | None = None, batch_invariant: bool = False,
                   route: AttentionRoute | None = None) -> AttentionBackend:
    """The backend `name` ("auto" resolved for `device`), built for layers of `shape`.

    On the CPU, `route` (the platform's, `CpuPlatform.attention_backend`) says which backend
    and kernels run; without one it is decided here by the same function
    (`paths.decide_attention`) from `kernels` (the compiled module, or None) and
    `batch_invariant` (one fixed reduction order per query row whatever the step holds: only
    the cpu backend with the kernels offers it, ValueError otherwise)."""
    resolved = resolve_backend_name(name, device.type)
    if route is None:
        if device.type != "cpu":
            if batch_invariant:
                raise ValueError(f"batch_invariant needs the cpu attention backend with the "
                                 f"C++ kernels (got {resolved!r}, kernels "
                                 f"{'on' if kernels is not None else 'off'})")
            return _backend_class("sdpa")(shape, device, kernels)
        route = decide_attention(
            shape.dtype, shape.head_dim, shape.sliding_window,
            max_head_dim=None if kernels is None else kernels.max_head_dim(),
            prefill_bf16=kernels is not None and kernels.has_bf16_gemm()
            and kernels.prefill_head_dim_ok(shape.head_dim),
            amx=kernels is not None and kernels.has_amx(), batch_invariant=batch_invariant,
            attention_backend=resolved)
    if route.backend == "cpu-kernel":
        return _backend_class(route.backend)(shape, device, kernels, route)
    return _backend_class(route.backend)(shape, device, kernels)


def _backend_class(backend: str) -> type[AttentionBackend]:
    module_name, _, class_name = _REGISTRY[backend].partition(":")
    return getattr(importlib.import_module(module_name), class_name)
