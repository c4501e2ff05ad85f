"""Prompt-lookup (n-gram) drafts: what followed the last time the request's newest tokens appeared.

For a request whose tokens end with the n-gram `g` (n from `prompt_lookup_max` down to
`prompt_lookup_min`, longest first), the draft is the up to k tokens that followed the
most recent earlier occurrence of `g` in its prompt or output. No weights, no tensors.

Each request keeps an index, for every n, from n-gram to the position just after its most
recent occurrence, grown by the tokens appended since the last call: a proposal costs one
dictionary lookup per n, whatever the request's length, instead of a scan of its tokens.

    tokens: a b c d a b c d a b            suffix "a b" (n = 2) last seen ending at 5
                    ^ 6                    -> draft tokens[6:6 + k] = c d a b

A match that runs into the end continues with its period (a loop shorter than k repeats).
"""

from __future__ import annotations

from typing import Protocol


class Tokens(Protocol):
    """What a proposal reads of a request: its prompt + outputs, by slices (`Request`)."""

    @property
    def num_tokens(self) -> int: ...

    def token_ids_slice(self, start: int, end: int) -> list[int]: ...


class NgramIndex:
    """One request's n-gram -> next-position index over its tokens so far."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self._sizes = range(max_n, min_n - 1, -1)  # longest first
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> position after its latest match
        self._num_indexed = 0  # tokens[:_num_indexed] have their n-grams ending there indexed

    def propose(self, tokens: Tokens, k: int) -> list[int]:
        """k draft tokens to follow `tokens` (a request's prompt + outputs, which only grow
        between calls), [] when no suffix of min_n..max_n tokens occurred before."""
        num_tokens = tokens.num_tokens
        largest = self._sizes[0]
        if self._num_indexed < num_tokens:
            # Index the n-grams that end before the last token: each is followed by a known
            # token, so the suffix itself (not yet followed) never matches itself.
            first = max(self._num_indexed, 1)
            window_start = max(first - largest, 0)
            window = tokens.token_ids_slice(window_start, num_tokens)
            index = self._next
            for end in range(first, num_tokens):
                local = end - window_start
                for n in self._sizes:
                    if n <= end:
                        index[tuple(window[local - n:local])] = end
            self._num_indexed = num_tokens
        suffix = tokens.token_ids_slice(max(num_tokens - largest, 0), num_tokens)
        for n in self._sizes:
            if n > len(suffix):
                continue
            start = self._next.get(tuple(suffix[len(suffix) - n:]))
            if start is not None:
                # Past the end the match continues with period num_tokens - start: a loop
                # shorter than k repeats (the draft's own tokens continue it).
                draft = tokens.token_ids_slice(start, min(start + k, num_tokens))
                for i in range(len(draft), k):
                    draft.append(draft[i - (num_tokens - start)])
                return draft
        return []
