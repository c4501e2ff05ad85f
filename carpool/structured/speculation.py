"""Structured outputs under speculative decoding: which drafts a grammar lets through, and
the masks of every position a speculating step samples.

A step verifies a request's drafts d1..dk by sampling 1 + k positions, position j after
d1..dj. Under a grammar each position is sampled under its own mask: the matcher's state
after d1..dj. So the drafts are cut first to the prefix the grammar accepts
(`accepted_drafts`): past a token the grammar refuses there is no state to mask from.

The cut also drops a draft that would complete the grammar, and everything after it. That
token ends the output, and without speculation it is the last token its step emits (the
request finishes on it, nothing is sampled after it); as a draft it would be followed by a
bonus token sampled where the grammar allows only EOS. Cut, it can still come as the token
sampled at the row before it, under the same mask, so the tokens emitted are those of a run
without speculation.

The matchers move only here and in the engine's `advance` (after the step): drafts are
consumed and rolled back within each call, so a matcher is where the engine left it
whenever the engine reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, wait

import llguidance

from carpool.structured.bitmask import BitmaskFiller, GrammarBitmask


def accepted_drafts(matcher: llguidance.LLMatcher, drafts: Sequence[int]) -> int:
    """How many of `drafts` (a prefix) may be verified under the matcher's grammar: those
    it accepts, up to (not including) one that completes the grammar. The matcher is left
    as it was."""
    if not drafts or matcher.is_error() or matcher.is_stopped():
        return 0
    num_valid = matcher.validate_tokens(list(drafts))
    consumed = 0
    for token_id in drafts[:num_valid]:
        if not matcher.consume_token(token_id):  # (validated: only if llguidance disagrees)
            break
        consumed += 1
        if matcher.is_stopped():
            break
    stopped = matcher.is_stopped() or matcher.is_error()
    if consumed:
        matcher.rollback(consumed)
    return consumed - 1 if stopped else consumed


class StepGrammar:
    """One step's requests sampled under a grammar, by id: the drafts each accepts, the
    masks a draft model draws under, and the masks of every verified position (begun on the
    filler's thread before the model runs, awaited once the logits exist)."""

    def __init__(self, filler: BitmaskFiller,
                 matchers: dict[str, llguidance.LLMatcher]) -> None:
        self._filler = filler
        self._matchers = matchers
        self._future: Future | None = None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def accepted_drafts(self, request_id: str, drafts: Sequence[int]) -> int:
        """`accepted_drafts` for this request's matcher (0 for a request without one)."""
        matcher = self._matchers.get(request_id)
        return 0 if matcher is None else accepted_drafts(matcher, drafts)

    def masks_after(self, rows: Sequence[tuple[str, Sequence[int]]]) -> GrammarBitmask:
        """One mask per (request id, drafts so far): the position after those drafts (which
        must be accepted ones), computed now, on the calling thread."""
        matchers = []
        for request_id, drafts in rows:
            matcher = self._matchers[request_id]
            if drafts:
                matcher.consume_tokens(list(drafts))
            matchers.append((request_id, matcher))
        try:
            return self._filler.fill(matchers)
        finally:
            for request_id, drafts in rows:
                if drafts:
                    self._matchers[request_id].rollback(len(drafts))

    def start(self, drafts: dict[str, Sequence[int]]) -> None:
        """Begin the masks of every request, 1 + k rows for one with k `drafts` (accepted
        ones, `accepted_drafts`), in the order the requests were given."""
        self._future = self._filler.start(list(self._matchers.items()), drafts)

    def result(self) -> GrammarBitmask:
        if self._future is None:
            self.start({})
        return self._future.result()

    def wait(self) -> None:
        """Until the masks are done (the matchers are about to be dropped or moved)."""
        if self._future is not None:
            wait([self._future])
