"""Which LoRA adapter a request runs under: a value that crosses every layer.

As vLLM's `LoRARequest`: a name (what a client sends as `"model"`), an integer id unique
per loaded adapter (the scheduler counts distinct ids, the prefix cache keys blocks by it,
the runner caches weights by it) and the folder PEFT wrote. Two requests with the same
id must name the same adapter; a reloaded adapter gets a new id, so blocks its earlier
copy computed are never shared with it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None  # the served model it extends (/v1/models' parent)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")


@dataclass(frozen=True)
class LoraConfig:
    """`EngineConfig.lora` (None: adapters off), vLLM's flags of the same names."""

    max_loras: int = 1  # distinct adapters in one step
    max_lora_rank: int = 16  # the largest rank an adapter may have
    max_cpu_loras: int | None = None  # adapters kept loaded (LRU); None: max_loras

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is not None and (
                isinstance(self.max_cpu_loras, bool) or not isinstance(self.max_cpu_loras, int)
                or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras "
                             f"({self.max_loras}), got {self.max_cpu_loras!r}")

    @staticmethod
    def check_engine(lora, tensor_parallel_size: int, batch_invariant: bool,
                     scheduler: str) -> None:
        """ValueError naming enable_lora where adapters cannot run: their term is added by
        the single-rank layers, per group of rows (not batch invariant), under the continuous
        scheduler (which holds max_loras)."""
        if not isinstance(lora, LoraConfig):
            raise ValueError(f"lora must be a LoraConfig, got {lora!r}")
        for bad, reason in ((tensor_parallel_size != 1, "tensor_parallel_size 1"),
                            (batch_invariant, "batch_invariant off"),
                            (scheduler != "continuous", "the continuous scheduler")):
            if bad:
                raise ValueError(f"enable_lora needs {reason}")

    @property
    def capacity(self) -> int:
        """Adapters held in memory at most."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
