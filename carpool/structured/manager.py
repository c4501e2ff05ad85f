"""The engine's side of structured outputs: a matcher per constrained request, and its masks.

The engine asks for a matcher when a request arrives. A grammar compiled before comes from
the cache at once; a new one compiles on the one compile thread, never on the engine's step
thread (a big grammar takes seconds, which would freeze every stream), and the request
waits outside the scheduler until `compiled` hands its matcher over. That thread has a big
stack: the server's checker process, on a default stack, passes only grammars that compile
within it. A bad grammar is a ValueError naming the field. Each step's masks are begun
before the model runs (`step_grammar`, a `StepGrammar`: with speculative decoding, one per
verified position), and the engine advances a request's matcher with every token it samples.
A grammar that fails during generation (one that matches nothing, or outgrows the parser's
limits on the way) is a `GrammarError`: the request ends with `error`, never `stop`, since
its text breaks the constraint. Nothing is built until the first constrained request, so
servers that never see one never load the tokenizer view.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import llguidance

from carpool.sampling_params import GrammarLimits, SamplingParams, StructuredOutputsParams
from carpool.structured.bitmask import BitmaskFiller
from carpool.structured.compiler import GrammarCompiler
from carpool.structured.grammar import error_reason
from carpool.structured.speculation import StepGrammar

logger = logging.getLogger(__name__)

# The compile thread's stack: llguidance recurses once per chained rule (about 3 KiB a level),
# and only the pages it touches are ever committed.
COMPILE_STACK_BYTES = 256 * 1024 * 1024


class GrammarError(Exception):
    """A request's matcher failed during generation; the message says why, without the grammar."""


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_memory: int, limits: GrammarLimits | None = None) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._cache_memory = cache_memory
        self._limits = limits
        self._compiler: GrammarCompiler | None = None
        self._filler: BitmaskFiller | None = None
        self._compile_thread: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future] = {}  # request id -> its matcher, compiling

    def matcher_for(self, params: SamplingParams) -> llguidance.LLMatcher | None:
        """A fresh matcher for a request's grammar, None when it has none; ValueError naming
        `structured_outputs` when the grammar does not compile. Blocks while it compiles."""
        if params.structured_outputs is None:
            return None
        return self._compile(params.structured_outputs).result()

    def start(self, request_id: str, params: SamplingParams) -> llguidance.LLMatcher | None:
        """The request's matcher when it is ready now (cached, or no grammar: None); else its
        compile starts and `compiled` hands the matcher over once built. ValueError naming
        `structured_outputs` when it is known bad already."""
        if params.structured_outputs is None:
            return None
        future = self._compile(params.structured_outputs)
        if future.done():
            return future.result()
        self._pending[request_id] = future
        return None

    def is_compiling(self, request_id: str) -> bool:
        return request_id in self._pending

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop these requests' compiles (aborted); a compile in flight still fills the cache."""
        for request_id in request_ids:
            self._pending.pop(request_id, None)

    def compiled(self, wait_s: float = 0.0) -> list[tuple[str, llguidance.LLMatcher | None,
                                                           str | None]]:
        """(request id, matcher, None) for each compile that finished, (request id, None,
        error) for each that failed; waits up to `wait_s` for one when none has."""
        if self._pending and wait_s > 0:
            wait(list(self._pending.values()), timeout=wait_s, return_when=FIRST_COMPLETED)
        done = []
        for request_id, future in list(self._pending.items()):
            if future.done():
                del self._pending[request_id]
                try:
                    done.append((request_id, future.result(), None))
                except ValueError as exc:
                    done.append((request_id, None, str(exc)))
        return done

    def _compile(self, params: StructuredOutputsParams) -> Future:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size,
                                             self._eos_token_ids, self._cache_memory,
                                             self._limits)
            self._filler = BitmaskFiller(self._vocab_size, self._compiler.eos_token_ids)
            self._compile_thread = _big_stack_thread()
        future: Future = Future()
        matcher = self._compiler.cached(params)
        if matcher is not None:
            future.set_result(matcher)
            return future
        return self._compile_thread.submit(self._compiler.matcher, params)

    def step_grammar(self, rows: Iterable[tuple[str, llguidance.LLMatcher]]
                     ) -> StepGrammar | None:
        """The grammar work of this step's sampled constrained rows (request id, matcher):
        their drafts and masks; None when there are none (the step then pays nothing)."""
        matchers = dict(rows)
        if not matchers:
            return None
        return StepGrammar(self._filler, matchers)

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


def _big_stack_thread() -> ThreadPoolExecutor:
    """A one-thread executor whose thread has COMPILE_STACK_BYTES of stack."""
    executor = ThreadPoolExecutor(1, thread_name_prefix="carpool-grammar-compile")
    previous = threading.stack_size(COMPILE_STACK_BYTES)
    try:  # the executor starts its one thread on the first submit, under this stack size
        executor.submit(int).result()
    finally:
        threading.stack_size(previous)
    return executor
