"""The KV cache on transparent huge pages on CPU, so decode attention stops missing the TLB.

A decode step reads every running request's keys and values, block by block, from
anywhere in a cache of gigabytes: with 4 KiB pages nearly every block is a TLB miss and a
page-table walk, and the walks, not the bytes, set the pace. Linux backs memory with
2 MiB pages where asked (`madvise(MADV_HUGEPAGE)`, honoured when
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`); one 2 MiB page
holds 512 of the 135M model's 16-token blocks of one kv head. The advice must come before
the pages are first touched, so the cache is allocated empty, advised, then zeroed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch

logger = logging.getLogger(__name__)

_MADV_HUGEPAGE = 14
HUGE_PAGE_BYTES = 2 * 1024 * 1024
_madvise = None


def _libc_madvise():
    """libc's madvise, or None where there is none (not glibc/musl, not Linux)."""
    global _madvise
    if _madvise is None:
        path = ctypes.util.find_library("c")
        try:
            fn = ctypes.CDLL(path, use_errno=True).madvise if path else None
        except (OSError, AttributeError):
            fn = None
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
        _madvise = fn or False
    return _madvise or None


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for huge pages under the whole 2 MiB pages `tensor`'s storage spans; True if the
    kernel took the advice. Call before the memory is first written."""
    madvise = _libc_madvise()
    if madvise is None:
        return False
    address = tensor.data_ptr()
    nbytes = tensor.untyped_storage().nbytes()
    start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (address + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= start:
        return False
    return madvise(start, end - start, _MADV_HUGEPAGE) == 0


def zeros_on_huge_pages(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, advised onto huge pages before it is zeroed."""
    tensor = torch.empty(shape, dtype=dtype)
    advise_huge_pages(tensor)
    return tensor.zero_()
