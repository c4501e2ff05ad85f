"""The KV cache on transparent huge pages on CPU, so decode attention stops missing the TLB.

A decode step reads every running request's keys and values, block by block, from
anywhere in a cache of gigabytes: with 4 KiB pages nearly every block is a TLB miss and a
page-table walk. Linux backs memory with 2 MiB pages where asked (`madvise(MADV_HUGEPAGE)`,
honoured when /sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`); one
2 MiB page holds 512 of the 135M model's 16-token blocks of one kv head.

The advice only shapes pages not yet touched, so each layer's cache gets a fresh anonymous
mapping of its own (not malloc's heap, which `cpu_memory` keeps and reuses), advised, then
zeroed, which faults the huge pages in at start-up rather than in the step loop. The
tensor keeps the mapping alive; it is unmapped when the tensor goes.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE_BYTES = 2 * 1024 * 1024


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, its memory advised onto huge pages (plain
    torch.zeros where the platform has no MADV_HUGEPAGE, or below one huge page)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * element_size
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    # One huge page more than needed, so the tensor can start on a huge-page boundary.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(advice)
    except OSError:  # THP "never", or a kernel without it: small pages, as torch.zeros
        pass
    address = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    offset = -address % HUGE_PAGE_BYTES
    tensor = torch.frombuffer(mapping, dtype=dtype, count=math.prod(shape), offset=offset)
    return tensor.view(shape).zero_()
