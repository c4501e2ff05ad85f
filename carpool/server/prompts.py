"""Prompts to token ids on worker threads, never on the event loop or in the engine.

Tokenizing a long text or rendering a chat template is Python and Rust work of
up to seconds for a multi-megabyte body; on the event loop it would freeze
every stream and /health for that long. `TokenizerWorker` does it on two
threads instead, each a *lane* with its own queue: one for the prompts of
generation requests, one for /tokenize and /detokenize, so that no generation
request waits behind another client's /tokenize work. Each queue is bounded
(`max_jobs`; beyond it a 503 with Retry-After), and a job whose client went
away before it started is dropped, not run (the route cancels its wait).

Two checks keep hopeless prompts cheap: a text whose UTF-8 length is more
than `max_model_len` times the longest token's could never fit (every token
covers at most that many bytes), so it is refused before tokenizing; and the
context length is checked on the id count before the engine walks the ids.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from carpool.engine.limits import check_context_length
from carpool.engine.output_stream import EngineInfo
from carpool.engine.tokenizer import encode_prompt
from carpool.sampling_params import SamplingParams
from carpool.server.errors import APIError

DEFAULT_MAX_TOKENIZER_QUEUE = 256  # jobs queued or running per lane
RETRY_AFTER_S = 1


class _Lane:
    """One thread and its bounded queue of jobs (event-loop side: `num_jobs` is not locked)."""

    def __init__(self, name: str, max_jobs: int) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._name = name
        self._max_jobs = max_jobs
        self.num_jobs = 0

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.num_jobs >= self._max_jobs:
            raise APIError(503, f"The server is overloaded: {self.num_jobs} tokenization jobs "
                           f"are queued ({self._name}, --max-tokenizer-queue {self._max_jobs}); "
                           f"retry after {RETRY_AFTER_S}s.", code="server_overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.num_jobs += 1
        try:
            # Cancelling this wait cancels the job too if it has not started.
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self.num_jobs -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class TokenizerWorker:
    """The server's tokenizing threads: `run(fn, *args)` awaits `fn(*args)` run on the
    generation lane, `run_tokenize` on the /tokenize lane."""

    def __init__(self, max_jobs: int = DEFAULT_MAX_TOKENIZER_QUEUE) -> None:
        self._prompts = _Lane("carpool-tokenizer", max_jobs)
        self._tokenize = _Lane("carpool-tokenize-route", max_jobs)
        self._max_token_bytes: dict[int, int] = {}  # id(tokenizer) -> longest token's bytes

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._prompts.run(fn, *args)

    async def run_tokenize(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._tokenize.run(fn, *args)

    def shutdown(self) -> None:
        self._prompts.shutdown()
        self._tokenize.shutdown()

    def prompt_token_ids(self, info: EngineInfo, prompt: str | list[int],
                         params: SamplingParams) -> list[int]:
        """Token ids of one prompt (worker thread), checked against the context length;
        ValueError in the engine's words if it cannot fit."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            self.check_text_can_fit(info, prompt)
            prompt = encode_prompt(info.tokenizer, prompt, max_tokens=info.max_model_len)
        check_context_length(len(prompt), params, info.max_model_len)
        return prompt

    def check_text_can_fit(self, info: EngineInfo, text: str) -> None:
        """ValueError if `text` has surely more than `max_model_len` tokens, by its length."""
        num_bytes = len(text.encode("utf-8", errors="surrogatepass"))
        at_least = -(-num_bytes // self._longest_token_bytes(info.tokenizer))
        if at_least > info.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {info.max_model_len} tokens. However, "
                f"the prompt is {num_bytes} bytes, at least {at_least} tokens. Please reduce "
                "the length of the prompt.")

    def _longest_token_bytes(self, tokenizer) -> int:
        key = id(tokenizer)
        if key not in self._max_token_bytes:
            # A token's string over-counts the bytes it stands for (byte-level BPE's 'Ġ',
            # SentencePiece's '<0x0A>'), so the bound only ever lets more text through.
            self._max_token_bytes[key] = max(
                (len(token.encode("utf-8", errors="surrogatepass"))
                 for token in tokenizer.get_vocab()), default=1) or 1
        return self._max_token_bytes[key]
