"""The CPU runner keeps freed memory in glibc's heap (see carpool/platform/cpu_memory.py)."""

from __future__ import annotations

import platform

import pytest

from carpool.platform.cpu_memory import keep_freed_memory_in_heap


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_applies_on_glibc_and_is_idempotent():
    assert keep_freed_memory_in_heap() is True
    assert keep_freed_memory_in_heap() is True
