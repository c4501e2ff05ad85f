"""The interface the model runner uses to set up a device (see `carpool.platform`)."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from carpool.attention import AttentionBackend, AttentionShape, create_backend


class Platform:
    # True: the KV cache is sized from a memory budget measured after a profiling
    # forward pass (`begin_profile` / `kv_cache_budget`); False: `default_kv_cache_bytes`.
    profiles_memory: bool = False

    def prepare_process(self) -> None:
        """Process-wide tuning, once, before the model is loaded."""

    def prepare_model(self, model: nn.Module) -> None:
        """Rewrite the loaded model for this device (e.g. pack its linear layers)."""

    def quant_linear_packer(self, dtype: torch.dtype):
        """A callable the loader passes each quantized linear to as soon as it is read (so
        the platform can pack it and free the loaded copy before the next); None: the
        linears are left to `prepare_model`."""
        return None

    def attention_backend(self, name: str, shape: AttentionShape,
                          device: torch.device) -> AttentionBackend:
        """The attention backend `name` ("auto" resolved for `device`) for layers of `shape`."""
        return create_backend(name, shape, device, kernels=self.compiled_kernels())

    def compiled_kernels(self) -> ModuleType | None:
        """The compiled kernels module the attention backend and model may use, if any."""
        return None

    def kv_cache_zeros(self, shape: tuple[int, ...], dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
        """One layer's KV cache tensor, zeroed."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def default_kv_cache_bytes(self) -> int:
        """KV cache bytes when nothing else sizes it (platforms that do not profile)."""
        raise NotImplementedError(f"{type(self).__name__} sizes the KV cache by profiling")

    def begin_profile(self) -> None:
        """Start measuring peak memory (platforms that profile)."""

    def end_profile(self) -> None:
        """Stop measuring; release what the profiling pass cached."""

    def describe(self) -> str:
        """One line for the start-up log."""
        raise NotImplementedError

    def kv_cache_budget(self, utilization: float) -> int:
        """Bytes left for the KV cache after the profiled peak (platforms that profile)."""
        raise NotImplementedError(f"{type(self).__name__} does not profile memory")
