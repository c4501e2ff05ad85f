"""Everything needed to build an engine: model, device, KV cache size, scheduler.

One frozen dataclass shared by `LLM(...)`, `carpool serve` flags and the
benchmarks, so a setting has one name everywhere (vLLM's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from carpool.attention import check_backend_name
from carpool.core.config import SchedulerConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF folder or hub id; None: the built-in default model
    dtype: str = "auto"  # auto takes the checkpoint's (float32 on CPU for float16 checkpoints)
    device: str = "auto"  # auto: cuda if available, else cpu
    seed: int = 0
    served_model_name: str | None = None
    # KV cache size, first that is set wins: explicit blocks, bytes, GPU fraction, CPU default.
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    # Scheduler settings; max_model_len 0 means "from the model's config".
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_model_len: int | None = None  # None: the model's max_position_embeddings (capped)
    # Attention kernels: auto (cpu on CPU, sdpa elsewhere), cpu, sdpa (see carpool.attention).
    attention_backend: str = "auto"
    # CPU platform switches (see carpool.platform.cpu); ignored on CUDA.
    cpu_packed_linears: bool = True  # linear layers through oneDNN with pre-packed weights
    cpu_malloc_tuning: bool = True  # glibc malloc keeps freed memory in the heap

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int)
                                               or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int)
                                                 or self.kv_cache_memory < 1):
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, "
                             f"got {self.kv_cache_memory!r}")
        check_backend_name(self.attention_backend)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization!r}")
