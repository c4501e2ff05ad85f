"""The engine's side of structured outputs: a matcher per constrained request, and its masks.

The engine asks for a matcher when a request arrives (compiled through the cache; a bad
grammar is a ValueError naming the field), starts each step's masks before the model runs,
and advances a request's matcher with every token it samples. A grammar that fails during
generation (one that matches nothing, or outgrows the parser's limits on the way) is a
`GrammarError`: the request ends with `error`, never `stop`, since its text breaks the
constraint. Nothing is built until the
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

# llguidance's error text is one line of reason, then its state and the whole grammar (which
# can be megabytes of the client's text): messages and logs keep the reason, this long at most.
MAX_ERROR_CHARS = 300
# Reasons llguidance names without saying what they mean.
_REASONS = {"NoExtensionBias": "no token can continue the output (the grammar may match "
                               "nothing here)"}


class GrammarError(Exception):
    """A request's matcher failed during generation; the message says why, without the grammar."""


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_memory: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._cache_memory = cache_memory
        self._compiler: GrammarCompiler | None = None
        self._filler: BitmaskFiller | None = None

    def matcher_for(self, params: SamplingParams) -> llguidance.LLMatcher | None:
        """A fresh matcher for a request's grammar, None when it has none; ValueError naming
        `structured_outputs` when the grammar does not compile."""
        if params.structured_outputs is None:
            return None
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size,
                                             self._eos_token_ids, self._cache_memory)
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
        (nothing but EOS may follow), so the request should finish with `stop`.
        GrammarError when the matcher failed, on these tokens or computing their mask (it
        then allowed only EOS): the output breaks the grammar."""
        if token_ids:
            matcher.consume_tokens(token_ids)
        if matcher.is_error():
            reason = error_reason(matcher.get_error())
            logger.warning("request %s: its grammar failed: %s", request_id, reason)
            raise GrammarError(f"the structured output's grammar failed during generation: "
                               f"{reason}")
        return matcher.is_stopped()


def error_reason(error: str) -> str:
    """The reason in a matcher's error text, on one line, without its state or grammar."""
    reason = " ".join(error.split("\n<state>", 1)[0].split())
    reason = _REASONS.get(reason, reason)
    if len(reason) > MAX_ERROR_CHARS:
        reason = reason[:MAX_ERROR_CHARS - 3] + "..."
    return reason
