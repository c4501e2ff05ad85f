"""What the engine checks before a request is queued: the context length, prompt tokens, and
that a request's own settings leave some token to generate.

Resolved once from the model and the user's settings, so every front end (the
offline `LLM`, the HTTP server) rejects the same requests with the same words.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from carpool.core.kv_fit import check_fits_pool
from carpool.engine.tokenizer import encode_prompt
from carpool.sampling_params import SamplingParams


def prompt_token_ids_of(prompt, tokenizer, max_model_len: int, vocab_size: int) -> list[int]:
    """Token ids of a text prompt (tokenized) or a token-id prompt (checked, copied)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        prompt_token_ids = encode_prompt(tokenizer, prompt, max_tokens=max_model_len)
    elif isinstance(prompt, (list, tuple)):
        check_prompt_list_length(len(prompt), max_model_len)  # before walking it in Python
        prompt_token_ids = prompt
    else:
        raise ValueError(f"prompt must be a string or a list of token ids, "
                         f"got {type(prompt).__name__}")
    return check_prompt_token_ids(prompt_token_ids, vocab_size)


def check_single_params(sampling_params: SamplingParams) -> None:
    """ValueError unless these are one request's SamplingParams (n=1: the engine's unit)."""
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, "
                         f"got {type(sampling_params).__name__}")
    if sampling_params.n != 1:
        raise ValueError(f"the engine takes n=1 requests only (got n={sampling_params.n}); "
                         "fan out n > 1 into separate requests above it")


def check_prompt_list_length(num_tokens: int, max_model_len: int) -> None:
    """ValueError for a token-id prompt longer than max_model_len (before walking it)."""
    if num_tokens > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, the "
            f"prompt has {num_tokens} tokens. Please reduce the length of the prompt.")


def check_prompt_token_ids(prompt_token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """The ids as a list of plain ints (numpy ints accepted); ValueError for an empty prompt,
    a non-integer, or an id outside [0, vocab_size)."""
    if not prompt_token_ids:
        raise ValueError("prompt must not be empty")
    token_ids = []
    for token_id in prompt_token_ids:
        if isinstance(token_id, bool):
            raise ValueError(f"prompt token ids must be integers, got {token_id!r}")
        try:
            token_id = operator.index(token_id)
        except TypeError:
            raise ValueError(f"prompt token ids must be integers, got {token_id!r}") from None
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"prompt token id {token_id} is out of range [0, {vocab_size})")
        token_ids.append(token_id)
    return token_ids


def check_num_logprobs(params: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    """ValueError when a request asks more logprobs per token than `--max-logprobs` allows
    (-1: the vocabulary), for its sampled tokens or its prompt."""
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        wanted = getattr(params, name, None)
        if wanted is not None and wanted > limit:
            raise ValueError(f"{name} must be <= {limit} (the server's --max-logprobs), "
                             f"got {wanted}")


def check_context_length(num_prompt_tokens: int, params: SamplingParams,
                         max_model_len: int) -> None:
    """ValueError in OpenAI's words when prompt + completion cannot fit max_model_len."""
    num_completion_tokens = params.max_tokens if params.max_tokens is not None else 1
    total = num_prompt_tokens + num_completion_tokens
    if total > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {total} tokens ({num_prompt_tokens} in the prompt, "
            f"{num_completion_tokens} for the completion). Please reduce the length of the "
            "prompt or completion.")


def check_fits_kv_cache(num_prompt_tokens: int, params: SamplingParams, max_model_len: int,
                        block_size: int, num_total_blocks: int) -> None:
    """ValueError when the prompt plus its largest possible output needs more KV blocks than
    the whole pool holds (the scheduler could never finish it); the scheduler checks the same."""
    num_output_tokens = max_model_len - num_prompt_tokens
    if params.max_tokens is not None:
        num_output_tokens = min(num_output_tokens, params.max_tokens)
    check_fits_pool(num_prompt_tokens, num_output_tokens, block_size, num_total_blocks)


def check_stop_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """ValueError for a stop token id outside [0, vocab_size): it could never be sampled, so
    it is a client's mistake (another model's tokenizer), refused as a prompt's would be."""
    bad = sorted(token_id for token_id in params.stop_token_ids if token_id >= vocab_size)
    if bad:
        raise ValueError(f"stop_token_ids must be ids in [0, {vocab_size}), got {bad[:5]}")


def check_some_token_allowed(params: SamplingParams, vocab_size: int,
                             eos_token_ids: Sequence[int]) -> None:
    """ValueError when, before `min_tokens` outputs, the stop tokens (and EOS unless
    `ignore_eos`) would mask every token of the vocabulary: nothing could be sampled."""
    if params.min_tokens == 0:
        return
    masked = set(params.stop_token_ids)
    if not params.ignore_eos:
        masked.update(eos_token_ids)
    if sum(1 for token_id in masked if token_id < vocab_size) >= vocab_size:
        raise ValueError(
            f"stop_token_ids: with min_tokens={params.min_tokens} these stop tokens"
            f"{'' if params.ignore_eos else ' and EOS'} mask all {vocab_size} tokens of the "
            "vocabulary, so no token could be generated")
