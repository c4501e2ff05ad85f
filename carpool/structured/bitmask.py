"""The allowed-token bitmask of a step's constrained rows, computed beside the forward pass.

A matcher's next mask depends only on the tokens it has consumed, which are known before
the model runs; so the engine starts the masks on a helper thread (llguidance releases the
GIL and spreads the rows over its own threads) and the sampler waits for them only after
the logits exist. Unconstrained rows get no mask row and pay nothing.

A matcher that reached the end of its grammar, or that broke (a token it refused: never
under its own mask), allows only EOS, so the request ends.

Under speculative decoding a request's step samples 1 + k positions, after each prefix of
its k drafts: its mask rows are 1 + k consecutive rows, filled by llguidance advancing the
matcher through the drafts and rolling it back (`fill`'s `drafts`; the drafts must be ones
the grammar accepts, `drafts.accepted_drafts`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np

BITS_PER_WORD = 32


@dataclass(frozen=True, eq=False)
class GrammarBitmask:
    """Row i of `bitmask` ([R, ceil(V / 32)] int32; bit t of word w allows token 32 w + t)
    is the mask of request `request_ids[i]`; a request named n times has n consecutive rows,
    one per position it samples (its own token, then one after each draft)."""

    request_ids: tuple[str, ...]
    bitmask: np.ndarray

    def allowed(self, vocab_size: int) -> np.ndarray:
        """[R, vocab_size] bool: which tokens each row may sample."""
        bits = np.unpackbits(self.bitmask.view(np.uint8), axis=1, bitorder="little")
        return bits[:, :vocab_size].view(np.bool_)

    def disallowed(self, vocab_size: int) -> np.ndarray:
        """[R, vocab_size] bool: which tokens each row may not sample."""
        bits = np.unpackbits(np.invert(self.bitmask.view(np.uint8)), axis=1, bitorder="little")
        return bits[:, :vocab_size].view(np.bool_)


class BitmaskFiller:
    """Computes `GrammarBitmask`es off the calling thread, one step at a time."""

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...],
                 num_threads: int = 2) -> None:
        self.num_words = -(-vocab_size // BITS_PER_WORD)
        self.eos_token_ids = eos_token_ids
        self._executor = llguidance.LLExecutor(num_threads)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="carpool-grammar")

    def start(self, rows: list[tuple[str, llguidance.LLMatcher]],
              drafts: Mapping[str, Sequence[int]] | None = None) -> Future:
        """Begin the masks of `rows` (request id, matcher) and of the positions after each
        speculating row's `drafts`; the future holds a GrammarBitmask. The matchers must not
        change until it is done."""
        return self._thread.submit(self.fill, rows, drafts)

    def fill(self, rows: list[tuple[str, llguidance.LLMatcher]],
             drafts: Mapping[str, Sequence[int]] | None = None) -> GrammarBitmask:
        drafts = drafts or {}
        num_rows = sum(1 + len(drafts.get(rid, ())) for rid, _ in rows)
        bitmask = np.zeros((num_rows, self.num_words), dtype=np.int32)
        words = bitmask.view(np.uint32)
        live, speculating, request_ids = [], [], []
        index = 0
        for request_id, matcher in rows:
            own = list(drafts.get(request_id, ()))
            if matcher.is_error() or matcher.is_stopped():  # (drafts: none are accepted)
                for token_id in self.eos_token_ids:
                    words[index:index + 1 + len(own), token_id // BITS_PER_WORD] |= np.uint32(
                        1 << (token_id % BITS_PER_WORD))
            elif own:
                speculating.append((matcher, index, own))
            else:
                live.append((matcher, index))
            request_ids.extend([request_id] * (1 + len(own)))
            index += 1 + len(own)
        if live:
            self._executor.unsafe_compute_mask_ptr(live, bitmask.ctypes.data,
                                                   self.num_words * 4, num_rows)
        if speculating:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                speculating, bitmask.ctypes.data, self.num_words * 4, num_rows)
        return GrammarBitmask(tuple(request_ids), bitmask)
