"""How many prompt tokens a request may take this step, and the partial-prefill limits.

A request is *part-way* through its prefill when a step leaves it with some of
its prompt (for a recomputed request: prompt + outputs) still uncomputed. At
most `max_num_partial_prefills` requests may be part-way at once, and of those
at most `max_long_partial_prefills` may be long (prefill longer than
`long_prefill_token_threshold`), so one long prompt never keeps short ones out.
A prompt that is computed whole within one step is never part-way and needs no
slot.
"""

from __future__ import annotations

from carpool.core.config import SchedulerConfig


class PartialPrefillSlots:
    """Counts the part-way prefills of the step being planned against the limits."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._max_num = config.max_num_partial_prefills
        self._max_long = config.max_long_partial_prefills
        self._threshold = config.effective_long_prefill_threshold
        self.num_partial = 0
        self.num_long = 0

    def is_long(self, num_prefill_tokens: int) -> bool:
        return self._threshold is not None and num_prefill_tokens > self._threshold

    def can_take(self, num_prefill_tokens: int) -> bool:
        if self.num_partial >= self._max_num:
            return False
        return not self.is_long(num_prefill_tokens) or self.num_long < self._max_long

    def take(self, num_prefill_tokens: int) -> None:
        self.num_partial += 1
        self.num_long += self.is_long(num_prefill_tokens)


def chunk_cap(config: SchedulerConfig) -> int | None:
    """The most prompt tokens one request may take in a step (None: no cap but the budget)."""
    return config.effective_long_prefill_threshold if config.enable_chunked_prefill else None


def prefill_chunk(num_remaining: int, token_budget: int, config: SchedulerConfig) -> int:
    """Tokens of a prefill to schedule now: the rest, cut to the budget and the chunk cap.

    Without chunked prefill the answer is all or nothing (0 when it does not fit).
    """
    if not config.enable_chunked_prefill:
        return num_remaining if num_remaining <= token_budget else 0
    cap = chunk_cap(config)
    num_tokens = min(num_remaining, token_budget)
    return num_tokens if cap is None else min(num_tokens, cap)
