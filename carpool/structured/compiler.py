"""Compile grammars against the model's tokenizer, once per distinct grammar.

Building a matcher compiles the grammar (well under a millisecond for a typical schema,
more for a big one); requests that share a schema — the usual case behind one API —
share the compiled template and each get a cheap deep copy. The cache is bounded (least
recently used out) so clients sending endless distinct schemas cannot grow it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import llguidance
import llguidance.hf

from carpool.sampling_params import StructuredOutputsParams
from carpool.structured.grammar import grammar_text

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256


class GrammarCompiler:
    """Owns the llguidance view of the tokenizer and the compiled-grammar cache."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        # The library's own adapter reads the Hugging Face tokenizer's vocabulary, byte-level
        # BPE and special tokens included; n_vocab is the model's (logit rows may exceed the
        # tokenizer's count: those ids are never allowed).
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids) or (self.tokenizer.eos_token,)
        self._cache_size = cache_size
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def matcher(self, params: StructuredOutputsParams,
                field: str = "structured_outputs") -> llguidance.LLMatcher:
        """A fresh matcher for `params` at the start of its grammar; ValueError naming `field`
        if the grammar does not compile."""
        text = grammar_text(params, field)
        template = self._templates.get(text)
        if template is None:
            template = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
            if template.is_error():
                raise ValueError(f"{field}: invalid {params.kind}: "
                                 f"{template.get_error().strip()}")
            self._templates[text] = template
            if len(self._templates) > self._cache_size:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(text)
        return template.deep_copy()

    @property
    def num_cached(self) -> int:
        return len(self._templates)
