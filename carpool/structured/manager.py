"""The engine's side of structured outputs: a matcher per constrained request, and its masks.

The engine asks for a matcher when a request arrives (compiled through the cache; a bad
grammar is a ValueError naming the field), starts each step's masks before the model runs,
and advances a request's matcher with every token it samples. Nothing is built until the
first constrained request, so servers that never see one never load the tokenizer view.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future

import llguidance

from carpool.sampling_params import SamplingParams
from carpool.structured.bitmask import BitmaskFiller
from carpool.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._filler: BitmaskFiller | None = None

    def matcher_for(self, params: SamplingParams) -> llguidance.LLMatcher | None:
        """A fresh matcher for a request's grammar, None when it has none; ValueError naming
        `structured_outputs` when the grammar does not compile."""
        if params.structured_outputs is None:
            return None
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size,
                                             self._eos_token_ids)
            self._filler = BitmaskFiller(self._vocab_size, self._compiler.eos_token_ids)
        return self._compiler.matcher(params.structured_outputs)

    def start_bitmask(self, rows: Iterable[tuple[str, llguidance.LLMatcher]]) -> Future | None:
        """Begin the masks of this step's sampled constrained rows (request id, matcher);
        None when there are none (the step then pays nothing)."""
        rows = list(rows)
        if not rows:
            return None
        return self._filler.start(rows)

    @staticmethod
    def advance(request_id: str, matcher: llguidance.LLMatcher, token_ids: list[int]) -> bool:
        """Feed the request's new tokens to its matcher; True when the grammar is complete
        (nothing but EOS may follow), so the request should finish with `stop`."""
        if token_ids and not matcher.consume_tokens(token_ids):
            # Never under the matcher's own mask; its next mask allows only EOS.
            logger.warning("request %s: grammar refused a sampled token: %s", request_id,
                           matcher.get_error())
        return matcher.is_stopped() or matcher.is_error()
