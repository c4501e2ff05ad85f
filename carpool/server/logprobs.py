"""Logprobs in the two shapes OpenAI uses: legacy completions and chat.

The engine gives, per output position, a dict token id -> `Logprob` holding the
chosen token and the top-N. Completions get parallel lists (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`); chat gets one entry per token
with its `bytes` and a `top_logprobs` list, most likely first.
"""

from __future__ import annotations

import functools
from typing import Any

from carpool.outputs import Logprob, PositionLogprobs, PromptLogprobs

_FLOOR = -9999.0  # JSON has no -inf


def _value(lp: Logprob | None) -> float | None:
    return None if lp is None else max(lp.logprob, _FLOOR)


def token_text(tokenizer: Any, token_id: int, lp: Logprob | None = None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return _decode_one(tokenizer, token_id)


@functools.lru_cache(maxsize=1 << 18)
def _decode_one(tokenizer: Any, token_id: int) -> str:
    """One token's text, remembered: a reply with prompt logprobs names the same few
    thousand tokens hundreds of thousands of times."""
    return tokenizer.decode([token_id])


def _ranked(position: PositionLogprobs) -> list[tuple[int, Logprob]]:
    return sorted(position.items(), key=lambda item: -item[1].logprob)


def completion_logprobs(tokenizer: Any, token_ids: list[int],
                        positions: list[PositionLogprobs | None],
                        text_offset: int, *, skip_special_tokens: bool = False) -> tuple[dict, int]:
    """The legacy `logprobs` object for these tokens, and the text offset after them. A None
    position (the prompt's first token) gets null logprobs. With `skip_special_tokens` (as
    the generated text was made) a special token is listed but adds nothing to the offset,
    so every offset points into the text the client got."""
    skipped = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) if position is not None else None
        text = token_text(tokenizer, token_id, chosen)
        result["tokens"].append(text)
        result["token_logprobs"].append(_value(chosen))
        result["top_logprobs"].append(None if position is None else _top_by_text(
            tokenizer, position))
        result["text_offset"].append(text_offset)
        if token_id not in skipped:
            text_offset += len(text)
    return result, text_offset


@functools.lru_cache(maxsize=8)
def special_token_ids(tokenizer: Any) -> frozenset[int]:
    return frozenset(getattr(tokenizer, "all_special_ids", ()))


def _top_by_text(tokenizer: Any, position: PositionLogprobs) -> dict[str, float]:
    """{token text: logprob}, most likely first; of tokens with the same text (the legacy shape
    keys by text) the likelier one is kept."""
    top: dict[str, float] = {}
    for t, lp in _ranked(position):
        top.setdefault(token_text(tokenizer, t, lp), _value(lp))
    return top


def chat_logprobs(tokenizer: Any, token_ids: list[int], positions: list[PositionLogprobs],
                  num_top: int) -> dict:
    """The chat `logprobs` object: `{"content": [...]}`, `num_top` alternatives per token."""
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id)
        text = token_text(tokenizer, token_id, chosen)
        top = []
        for t, lp in _ranked(position)[:num_top]:
            alt = token_text(tokenizer, t, lp)
            top.append({"token": alt, "logprob": _value(lp), "bytes": list(alt.encode("utf-8"))})
        content.append({"token": text, "logprob": _value(chosen),
                        "bytes": list(text.encode("utf-8")), "top_logprobs": top})
    return {"content": content}


def prompt_logprobs_body(tokenizer: Any, prompt_logprobs: PromptLogprobs | None) -> list | None:
    """vLLM's `prompt_logprobs` field: null for the first token, then per prompt token
    `{"<token id>": {"logprob", "rank", "decoded_token"}}` for the token and the top-N."""
    if prompt_logprobs is None:
        return None
    return [None if position is None else {
        str(t): {"logprob": _value(lp), "rank": lp.rank,
                 "decoded_token": token_text(tokenizer, t, lp)}
        for t, lp in position.items()} for position in prompt_logprobs.positions()]


# Logprob entries one request may ask for: a harness scoring 16 prompts of 2,048 tokens
# with 1 top logprob needs 65,536; each entry costs the front end several Python objects
# (and their garbage collection) to reply with.
DEFAULT_MAX_LOGPROB_WORK = 2**17


def check_logprob_work(params: Any, prompt_lengths: list[int], max_model_len: int,
                       limit: int) -> None:
    """ValueError naming `logprobs` when a request would return more than `limit` logprob
    entries: over its prompts and `n` choices, each scored prompt token carries
    `prompt_logprobs` + 1 of them and each generated token `logprobs` + 1.

    Such a reply is hundreds of megabytes of JSON, which costs the server (and the
    streams beside it) seconds of CPU to build; a harness that scores long prompts in
    batches stays well under the default."""
    if params.logprobs is None and params.prompt_logprobs is None:
        return
    work = 0
    for length in prompt_lengths:
        per_choice = 0
        if params.prompt_logprobs is not None:
            per_choice += length * (params.prompt_logprobs + 1)
        if params.logprobs is not None:
            max_tokens = params.max_tokens if params.max_tokens is not None else \
                max(max_model_len - length, 0)
            per_choice += max_tokens * (params.logprobs + 1)
        work += per_choice * params.n
    if work > limit:
        raise ValueError(
            f"logprobs: prompts x tokens x top-N is {work} logprob entries for this request "
            f"(prompt tokens x (prompt_logprobs + 1) + max_tokens x (logprobs + 1), for each "
            f"prompt and choice), more than the server's --max-logprob-work {limit}; ask for "
            "fewer prompts, tokens or top logprobs per request")
