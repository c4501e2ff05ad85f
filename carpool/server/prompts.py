"""Prompts to token ids on one worker thread, never on the event loop or in the engine.

Tokenizing a long text or rendering a chat template is Python and Rust work of
up to seconds for a multi-megabyte body; on the event loop it would freeze
every stream and /health for that long. The one `TokenizerWorker` thread does
it instead (one thread: requests are tokenized in order, and the tokenizer is
never entered by two threads at once for encoding).

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


class TokenizerWorker:
    """The server's tokenizing thread; `run(fn, *args)` awaits `fn(*args)` run there."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="carpool-tokenizer")
        self._max_token_bytes: dict[int, int] = {}  # id(tokenizer) -> longest token's bytes

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def prompt_token_ids(self, info: EngineInfo, prompt: str | list[int],
                         params: SamplingParams) -> list[int]:
        """Token ids of one prompt (worker thread), checked against the context length;
        ValueError in the engine's words if it cannot fit."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            self._check_text_can_fit(info, prompt)
            prompt = encode_prompt(info.tokenizer, prompt, max_tokens=info.max_model_len)
        check_context_length(len(prompt), params, info.max_model_len)
        return prompt

    def _check_text_can_fit(self, info: EngineInfo, text: str) -> None:
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
