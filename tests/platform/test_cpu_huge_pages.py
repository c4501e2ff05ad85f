"""The KV cache on transparent huge pages: the advice, the switch, and a zeroed cache either way."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from carpool.cpu_options import CpuOptions
from carpool.platform import CpuPlatform, platform_for
from carpool.platform.cpu_huge_pages import HUGE_PAGE_BYTES, zeros_on_huge_pages
from carpool.platform.cpu_memory import keep_freed_memory_in_heap

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_zeros_on_huge_pages_is_a_zeroed_tensor_of_that_shape():
    cache = zeros_on_huge_pages((2, 3, 100, 16, 64), torch.bfloat16)
    assert cache.shape == (2, 3, 100, 16, 64) and cache.dtype == torch.bfloat16
    assert cache.is_contiguous() and not cache.any()


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text()
                    or not Path("/proc/self/smaps_rollup").exists(),
                    reason="no transparent huge pages on this machine")
def test_a_large_cache_lands_on_huge_pages():
    keep_freed_memory_in_heap()  # as the engine does: freed heap memory is kept and reused
    touched = torch.ones(64 * HUGE_PAGE_BYTES // 4)
    del touched  # touched, freed, back in the heap
    before = anon_huge_kib()
    cache = zeros_on_huge_pages((64 * HUGE_PAGE_BYTES // 4,), torch.float32)  # 64 huge pages
    gained = anon_huge_kib() - before
    # the kernel falls back to small pages where it finds no free 2 MiB frame (a busy,
    # fragmented machine), so only ask that the advice took: at least one huge page
    assert gained >= HUGE_PAGE_BYTES // 1024, gained
    del cache


def test_the_cache_starts_on_a_huge_page_and_small_ones_stay_plain():
    cache = zeros_on_huge_pages((3 * HUGE_PAGE_BYTES // 2,), torch.bfloat16)
    assert cache.data_ptr() % HUGE_PAGE_BYTES == 0
    small = zeros_on_huge_pages((1000,), torch.float32)
    assert small.shape == (1000,) and not small.any()


def test_the_switch_picks_the_allocator(monkeypatch):
    used = []
    monkeypatch.setattr("carpool.platform.cpu.zeros_on_huge_pages",
                        lambda shape, dtype: used.append(shape) or torch.zeros(shape, dtype=dtype))
    cpu = torch.device("cpu")
    on = platform_for(cpu)
    off = platform_for(cpu, CpuOptions(kv_huge_pages=False))
    assert isinstance(on, CpuPlatform) and on.kv_huge_pages and not off.kv_huge_pages
    assert not on.kv_cache_zeros((4, 8), torch.float32, cpu).any() and used == [(4, 8)]
    assert not off.kv_cache_zeros((4, 8), torch.float32, cpu).any() and used == [(4, 8)]
    assert "KV cache huge pages on" in on.describe()


def test_the_flag_reaches_the_config():
    from carpool.config import EngineConfig
    from carpool.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert EngineConfig.from_cli_args(parser.parse_args([])).cpu.kv_huge_pages is True
    config = EngineConfig.from_cli_args(parser.parse_args(["--no-cpu-kv-huge-pages"]))
    assert config.cpu.kv_huge_pages is False
