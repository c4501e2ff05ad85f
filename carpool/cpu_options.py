"""The CPU platform's switches, as one frozen object on the engine config (`EngineConfig.cpu`).

At the public edges each switch keeps its vLLM-like name with a `cpu_` prefix: the
`LLM(..., cpu_kernels=False)` keyword and the `--no-cpu-kernels` flag (carpool.arg_utils)
both fill the field `kernels`. `from_args` is the one place that maps those names onto
the fields, so a new switch is a field here and its flag there; `carpool.platform.
platform_for` hands the fields to the `CpuPlatform`. All of them are ignored on CUDA.

Torch-free: the config validates with it before any model loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from carpool.utils.cpu_threads import validate as validate_threads_bind
from carpool.utils.cpu_threads import validate_spin_count

# A field `x` is the argument `cpu_x` of `LLM(...)` / `EngineConfig.from_args` and the flag
# `--cpu-x`; errors name it that way, since that is what the user wrote.
ARGUMENT_PREFIX = "cpu_"


@dataclass(frozen=True)
class CpuOptions:
    packed_linears: bool = True  # linear layers through oneDNN on weights packed once
    malloc_tuning: bool = True  # glibc malloc keeps freed memory in the heap
    kv_huge_pages: bool = True  # the KV cache on transparent huge pages (Linux)
    kernels: bool = True  # the C++ kernels (paged attention, fused RoPE), built on first use
    # Pin torch's threads one to a CPU: auto (in the processes carpool starts for the engine),
    # nobind, or CPU lists like "0-3" or "0-1|2-3" (see carpool.utils.cpu_threads).
    omp_threads_bind: str = "auto"
    # How many times an idle OpenMP thread of those processes spins before it sleeps (libgomp's
    # GOMP_SPINCOUNT; 0 sleeps at once). None: the environment's OMP_WAIT_POLICY /
    # GOMP_SPINCOUNT if set, else carpool's default (see carpool.utils.cpu_threads).
    omp_spin_count: int | None = None

    def __post_init__(self) -> None:
        for name in ("packed_linears", "malloc_tuning", "kv_huge_pages", "kernels"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{ARGUMENT_PREFIX}{name} must be True or False, got {value!r}")
        if not isinstance(self.omp_threads_bind, str):
            raise ValueError(f"cpu_omp_threads_bind must be a string, "
                             f"got {self.omp_threads_bind!r}")
        validate_threads_bind(self.omp_threads_bind)  # errors name cpu_omp_threads_bind
        validate_spin_count(self.omp_spin_count)  # and cpu_omp_spin_count

    @classmethod
    def argument_names(cls) -> tuple[str, ...]:
        """The public names of the fields: cpu_kernels, cpu_omp_threads_bind, ..."""
        return tuple(ARGUMENT_PREFIX + f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_args(cls, **cpu_args: Any) -> CpuOptions:
        """The options `LLM(...)`-style arguments describe (cpu_kernels=False, ...); a field
        not given keeps its default. TypeError names an argument that is none of them."""
        unknown = sorted(set(cpu_args) - set(cls.argument_names()))
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                            f"the CPU switches are {', '.join(cls.argument_names())}")
        return cls(**{name[len(ARGUMENT_PREFIX):]: value for name, value in cpu_args.items()})
