"""Which CPUs torch's intra-op threads are pinned to (`cpu_omp_threads_bind`, vLLM's
VLLM_CPU_OMP_THREADS_BIND), and the pinning itself.

The setting is "auto", "nobind", or a CPU list such as "0-3" or "0,2,4-5", optionally one list
per process separated by "|" ("0-1|2-3"). A process of the engine is one *slot*: replica r of
a data-parallel server, tensor-parallel rank k, is slot r * tensor_parallel_size + k. Its T
torch threads take the slot-th list when "|" splits the setting, else CPUs [slot * T,
(slot + 1) * T) of the one list.

"auto" pins only in processes carpool starts for the engine (the server's engine process,
its replicas and their ranks): they resolve it to the CPUs the process may run on
(`resolve_auto`) before the model loads. In a process that is not carpool's own (the offline
`LLM`, `--no-engine-process`) "auto" pins nothing: pinning the caller's main thread to one
CPU would also confine every process it starts later.

How long an idle thread of those processes spins before it sleeps is the other half
(`cpu_omp_spin_count`, `openmp_wait_environment`): libgomp reads it from the environment once,
as torch loads, so carpool can only set it for a process it is about to start.

Pinning by default follows vLLM, which pins (measured together with the spin in
docs/lab/20-the-server-s-sampler-pinned-threads-and.md); the short spin keeps a thread from
waiting out a descheduled sibling (docs/lab/21-a-short-openmp-spin-for-the-engine.md).

Torch-free (the config validates with it); `bind_threads` imports torch when it runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from types import ModuleType

logger = logging.getLogger(__name__)

AUTO = "auto"
NO_BIND = "nobind"

# Counted in libgomp's spins (PyTorch's OpenMP on Linux): long enough to bridge one operator's
# barrier to the next within a step, short enough that a thread whose sibling was descheduled
# soon yields the core (docs/lab/21-a-short-openmp-spin-for-the-engine.md).
DEFAULT_OMP_SPIN_COUNT = 10_000
OPENMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def parse_cpu_list(text: str) -> list[int]:
    """"0-2,5" -> [0, 1, 2, 5]; ValueError naming the setting on anything else."""
    cpus: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            raise ValueError(f"cpu_omp_threads_bind: {text!r} is not a CPU list like "
                             "'0-3' or '0,2,4-5'") from None
        if low < 0 or high < low:
            raise ValueError(f"cpu_omp_threads_bind: bad CPU range {part.strip()!r} in {text!r}")
        cpus.extend(range(low, high + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"cpu_omp_threads_bind: a CPU appears twice in {text!r}")
    return cpus


def validate(setting: str) -> None:
    """Raise ValueError unless `setting` is "auto", "nobind" or CPU lists."""
    if setting in (AUTO, NO_BIND):
        return
    for cpu_list in setting.split("|"):
        parse_cpu_list(cpu_list)


def resolve_auto(setting: str) -> str:
    """In a process carpool started for the engine: "auto" becomes the CPUs this process
    may run on; anything else is returned as is."""
    if setting != AUTO:
        return setting
    return ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0)))


def cpus_for_slot(setting: str, slot: int, num_threads: int) -> list[int] | None:
    """The CPUs slot `slot`'s `num_threads` threads pin to, one each; None to pin nothing
    ("auto" unresolved, "nobind", or too few CPUs in the list, which is logged)."""
    if setting in (AUTO, NO_BIND):
        return None
    lists = setting.split("|")
    if len(lists) > 1:
        cpus = parse_cpu_list(lists[slot]) if slot < len(lists) else []
    else:
        cpus = parse_cpu_list(setting)[slot * num_threads:(slot + 1) * num_threads]
    if len(cpus) < num_threads:
        logger.warning("cpu_omp_threads_bind=%s leaves %d CPU(s) for the %d thread(s) of "
                       "process slot %d: its threads stay unpinned", setting, len(cpus),
                       num_threads, slot)
        return None
    return cpus[:num_threads]


def bind_threads(setting: str, slot: int, kernels: ModuleType | None) -> list[int] | None:
    """Pin this process's torch threads as `setting` says for `slot`; the CPUs, or None."""
    import torch

    cpus = cpus_for_slot(setting, slot, torch.get_num_threads())
    if cpus is None:
        return None
    if kernels is None:
        logger.warning("cpu_omp_threads_bind=%s: pinning threads needs the C++ CPU kernels "
                       "(cpu_kernels, a compiler); the threads stay unpinned", setting)
        return None
    kernels.bind_threads(cpus)
    logger.info("torch threads pinned to CPU(s) %s", ",".join(map(str, cpus)))
    return cpus


def validate_spin_count(spin_count: int | None) -> None:
    """Raise ValueError unless `spin_count` is None or an integer >= 0."""
    if spin_count is not None and (isinstance(spin_count, bool) or not isinstance(spin_count, int)
                                   or spin_count < 0):
        raise ValueError(f"cpu_omp_spin_count must be an integer >= 0, got {spin_count!r}")


def openmp_wait_environment(spin_count: int | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that make a process started now spin `spin_count` times at an OpenMP
    barrier, then sleep (0: sleep at once). None: nothing when `environ` already sets
    OMP_WAIT_POLICY or GOMP_SPINCOUNT (the user's choice stands), else the default count.
    PASSIVE goes with the count so that libgomp does not spin at all when it runs more
    threads than the process has CPUs."""
    if spin_count is None:
        if any(name in environ for name in OPENMP_WAIT_VARIABLES):
            return {}
        spin_count = DEFAULT_OMP_SPIN_COUNT
    return {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(spin_count)}
