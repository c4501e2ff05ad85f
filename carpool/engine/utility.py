"""Named calls the front end may make on the engine between two steps.

By name, not by callable, so that they cross a process boundary as a string;
the in-process `AsyncEngine` runs the same functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def reset_prefix_cache(engine) -> int:
    """Forget every cached prefix block; how many free blocks were dropped."""
    return engine.reset_prefix_cache()


def checked_stats(engine) -> dict:
    """Fresh stats plus the block manager's integrity check: `"integrity": "ok"` or the fault."""
    try:
        engine.check_integrity()
        verdict = "ok"
    except AssertionError as exc:
        verdict = f"violated: {exc}"
    return {**engine.stats().as_dict(), "integrity": verdict}


def remove_lora(engine, lora_int_id: int) -> bool:
    """Forget a LoRA adapter unloaded by name and free its weights (its requests finish)."""
    return engine.remove_lora(lora_int_id)


UTILITIES: dict[str, Callable[..., Any]] = {
    "reset_prefix_cache": reset_prefix_cache,
    "checked_stats": checked_stats,
    "remove_lora": remove_lora,
}
