"""Compile grammars against the model's tokenizer, once per distinct grammar.

Building a matcher compiles the grammar (well under a millisecond for a typical schema,
more for a big one); requests that share a schema — the usual case behind one API —
share the compiled template and each get a cheap deep copy. The cache is bounded by the
bytes its templates hold (least recently used out), so clients sending endless distinct
or huge schemas cannot grow it. It is keyed by the request's params, so a lookup costs no
grammar conversion; lookups (`cached`) may come from any thread, compiles from one.

[NOTE] llguidance does not report a compiled grammar's size, so `estimated_bytes` takes it
from the grammar text's length: a fixed part plus a per-character part, both set above what
glibc's allocator counted per template for JSON schemas, choices and regexes (independent
of the vocabulary's size).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import llguidance
import llguidance.hf

from carpool.sampling_params import GrammarLimits, StructuredOutputsParams
from carpool.structured.grammar import error_reason, grammar_text

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
                 cache_memory: int, limits: GrammarLimits | None = None) -> None:
        # The library's own adapter reads the Hugging Face tokenizer's vocabulary, byte-level
        # BPE and special tokens included; n_vocab is the model's (logit rows may exceed the
        # tokenizer's count: those ids are never allowed).
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids) or (self.tokenizer.eos_token,)
        self.cache_memory = cache_memory  # estimated bytes the templates may hold
        self.num_cached_bytes = 0  # estimated, of the templates held now
        self.limits = limits  # None: unbounded (tests)
        self._templates: OrderedDict[StructuredOutputsParams, tuple[llguidance.LLMatcher, int]] \
            = OrderedDict()  # params -> (template, its estimated bytes)
        self._lock = threading.Lock()

    def matcher(self, params: StructuredOutputsParams,
                field: str = "structured_outputs") -> llguidance.LLMatcher:
        """A fresh matcher for `params` at the start of its grammar; ValueError naming `field`
        if the grammar is over the limits or does not compile. Caches the compiled template,
        evicting the least recently used ones until the estimated bytes fit `cache_memory`
        (a template larger than that alone is not kept)."""
        matcher = self.cached(params)
        if matcher is not None:
            return matcher
        text = grammar_text(params, field, self.limits)
        template = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if template.is_error():
            raise ValueError(f"{field}: invalid {params.kind}: "
                             f"{error_reason(template.get_error())}")
        self._keep(params, template, estimated_bytes(text))
        return template.deep_copy()

    def cached(self, params: StructuredOutputsParams) -> llguidance.LLMatcher | None:
        """A fresh matcher from the cached template of `params`; None if there is none."""
        with self._lock:
            entry = self._templates.get(params)
            if entry is None:
                return None
            self._templates.move_to_end(params)
        return entry[0].deep_copy()

    def _keep(self, params: StructuredOutputsParams, template: llguidance.LLMatcher,
              num_bytes: int) -> None:
        if num_bytes > self.cache_memory:
            return
        with self._lock:
            while self.num_cached_bytes + num_bytes > self.cache_memory:
                _, (_, evicted_bytes) = self._templates.popitem(last=False)
                self.num_cached_bytes -= evicted_bytes
            self._templates[params] = (template, num_bytes)
            self.num_cached_bytes += num_bytes

    @property
    def num_cached(self) -> int:
        return len(self._templates)
