"""Compile grammars against the model's tokenizer, once per distinct grammar.

Building a matcher compiles the grammar (well under a millisecond for a typical schema,
more for a big one); requests that share a schema — the usual case behind one API —
share the compiled template and each get a cheap deep copy. The cache is bounded by the
bytes its templates hold (least recently used out), so clients sending endless distinct
or huge schemas cannot grow it.

[NOTE] llguidance does not report a compiled grammar's size, so `estimated_bytes` takes it
from the grammar text's length: a fixed part plus a per-character part, both set above what
glibc's allocator counted per template for JSON schemas, choices and regexes (independent
of the vocabulary's size).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import llguidance
import llguidance.hf

from carpool.sampling_params import StructuredOutputsParams
from carpool.structured.grammar import grammar_text

logger = logging.getLogger(__name__)

# What a compiled template holds, estimated from its grammar text (see the NOTE above).
TEMPLATE_BASE_BYTES = 128 * 1024
TEMPLATE_BYTES_PER_CHAR = 128


def estimated_bytes(text: str) -> int:
    """The memory a template compiled from grammar `text` holds, estimated from its length."""
    return TEMPLATE_BASE_BYTES + TEMPLATE_BYTES_PER_CHAR * len(text)


class GrammarCompiler:
    """Owns the llguidance view of the tokenizer and the compiled-grammar cache."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_memory: int) -> None:
        # The library's own adapter reads the Hugging Face tokenizer's vocabulary, byte-level
        # BPE and special tokens included; n_vocab is the model's (logit rows may exceed the
        # tokenizer's count: those ids are never allowed).
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids) or (self.tokenizer.eos_token,)
        self.cache_memory = cache_memory  # estimated bytes the templates may hold
        self.num_cached_bytes = 0  # estimated, of the templates held now
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def matcher(self, params: StructuredOutputsParams,
                field: str = "structured_outputs") -> llguidance.LLMatcher:
        """A fresh matcher for `params` at the start of its grammar; ValueError naming `field`
        if the grammar does not compile. Caches the compiled template, evicting the least
        recently used ones until the estimated bytes fit `cache_memory` (a template larger
        than that alone is not kept)."""
        text = grammar_text(params, field)
        template = self._templates.get(text)
        if template is None:
            template = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
            if template.is_error():
                raise ValueError(f"{field}: invalid {params.kind}: "
                                 f"{template.get_error().strip()}")
            self._keep(text, template)
        else:
            self._templates.move_to_end(text)
        return template.deep_copy()

    def _keep(self, text: str, template: llguidance.LLMatcher) -> None:
        num_bytes = estimated_bytes(text)
        if num_bytes > self.cache_memory:
            return
        while self.num_cached_bytes + num_bytes > self.cache_memory:
            evicted, _ = self._templates.popitem(last=False)
            self.num_cached_bytes -= estimated_bytes(evicted)
        self._templates[text] = template
        self.num_cached_bytes += num_bytes

    @property
    def num_cached(self) -> int:
        return len(self._templates)
