"""The model's own tokenizer and chat template, loaded from its folder with transformers.

Only `AutoTokenizer` is used from transformers here: text <-> token ids and the
chat template. transformers' model code is never in the serving path.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# A chat message as the OpenAI API and the templates see it: {"role": ..., "content": ...}.
Message = dict[str, Any]

# transformers resolves its names lazily and not thread-safely: two threads loading their
# first tokenizer at once (the receiver threads of data-parallel replicas) can see
# "cannot import name 'AutoTokenizer'". One load at a time.
_LOAD_LOCK = threading.Lock()


def load_tokenizer(model_path: str | os.PathLike, chat_template: str | None = None):
    """Load the tokenizer saved beside the weights (`tokenizer.json` / `tokenizer_config.json`),
    or a GGUF file's own, with `chat_template` (the template text) in place of its own when given.

    Raises FileNotFoundError naming the folder when it holds no tokenizer files.
    """
    path = Path(model_path)
    if path.is_dir() and not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer in model folder {path} (expected one of {', '.join(_TOKENIZER_FILES)})")
    with _LOAD_LOCK:
        from transformers import AutoTokenizer
        if path.is_file() and path.suffix.lower() == ".gguf":
            # the file's own tokenizer and chat template, rebuilt by transformers
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    logger.info("tokenizer %s: %d tokens, eos %r", type(tokenizer).__name__, len(tokenizer),
                tokenizer.eos_token)
    return tokenizer


def load_engine_tokenizer(config, model_path: str | os.PathLike):
    """The tokenizer an `EngineConfig` names (`tokenizer`, else the model's own) with its
    `chat_template`: the engine and its front end (engine process) load the same one."""
    from carpool.models.paths import resolve_model_path
    return load_tokenizer(resolve_model_path(config.tokenizer) if config.tokenizer
                          else model_path, chat_template=config.chat_template)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def text_decoder(tokenizer) -> Callable[[list[int], bool], str]:
    """`decode(ids, skip_special_tokens)`: the tokenizer's `decode`, or straight its Rust
    tokenizer's where transformers' own `decode` would return just that.

    The incremental detokenizer decodes twice per request per step; the Python around the
    Rust call (to_py_obj, kwargs, the clean-up check) is ~60% of each call's 9 us.
    Taken only when transformers' generic fast-tokenizer `decode`/`_decode` would run (no
    subclass overrides them) with no clean-up of tokenization spaces.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    generic = ("TokenizersBackend", "PreTrainedTokenizerFast")  # transformers 5, 4
    if (_defined_by(tokenizer, "decode") == "PreTrainedTokenizerBase"
            and _defined_by(tokenizer, "_decode") in generic
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
            and type(backend).__module__.startswith("tokenizers")):
        return lambda ids, skip_special_tokens: backend.decode(
            ids, skip_special_tokens=skip_special_tokens)
    return lambda ids, skip_special_tokens: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens)


def _defined_by(obj, name: str) -> str | None:
    """Name of the transformers class in obj's MRO that defines `name` (None if not one)."""
    for cls in type(obj).__mro__:
        if name in cls.__dict__:
            return cls.__name__ if cls.__module__.startswith("transformers.") else None
    return None


def encode_prompt(tokenizer, prompt: str, *, max_tokens: int | None = None) -> list[int]:
    """Token ids of a plain-text prompt, with the special tokens (BOS) the tokenizer adds;
    with `max_tokens`, a prompt surely longer than that is refused early (`encode_bounded`)."""
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    return encode_bounded(tokenizer, prompt, add_special_tokens=True, max_tokens=max_tokens)


# A first prefix this many characters per allowed token; each next one 4x longer.
_PREFIX_CHARS_PER_TOKEN = 8
# Tokens a prefix may have beyond the text's own at the cut (a word split in two).
_CUT_SLACK_TOKENS = 64


def encode_bounded(tokenizer, text: str, *, add_special_tokens: bool,
                   max_tokens: int | None) -> list[int]:
    """`tokenizer.encode(text)`, except that a text surely longer than `max_tokens` tokens is
    refused (ValueError) after tokenizing only a prefix of it.

    A 4 MB prompt takes seconds of CPU to tokenize, only to be refused by the length
    check. Prefixes of growing length (8 characters per allowed token, then 4x longer
    each time) are tokenized first; once one has more than `max_tokens` tokens plus a
    slack for the word cut at its end, the whole text has too. A text that fits is
    tokenized whole, at most ~1.3x the work of tokenizing it once, and only when it is
    longer than 8 characters per allowed token.
    """
    if max_tokens is not None:
        bound = max_tokens + _CUT_SLACK_TOKENS
        prefix_chars = _PREFIX_CHARS_PER_TOKEN * bound
        while prefix_chars < len(text):
            num_tokens = len(tokenizer.encode(text[:prefix_chars],
                                              add_special_tokens=add_special_tokens))
            if num_tokens > bound:
                raise ValueError(
                    f"This model's maximum context length is {max_tokens} tokens. However, "
                    f"the prompt has more than {num_tokens - _CUT_SLACK_TOKENS} tokens (its "
                    f"first {prefix_chars} of {len(text)} characters alone). Please reduce "
                    "the length of the prompt.")
            prefix_chars *= 4
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def render_chat(tokenizer, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                chat_template: str | None = None, **template_kwargs) -> str:
    """The conversation rendered through the model's chat template, as text."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model's tokenizer has no chat_template; "
                         "pass chat_template=... or use generate() with a plain prompt")
    _validate_messages(messages)
    return tokenizer.apply_chat_template(
        list(messages), chat_template=template, tokenize=False,
        add_generation_prompt=add_generation_prompt, **template_kwargs)


def encode_chat(tokenizer, messages: Sequence[Message], *, max_tokens: int | None = None,
                **kwargs) -> list[int]:
    """Token ids of the rendered conversation; the template already holds any BOS it wants.
    With `max_tokens`, a conversation surely longer than that is refused early."""
    text = render_chat(tokenizer, messages, **kwargs)
    return encode_bounded(tokenizer, text, add_special_tokens=False, max_tokens=max_tokens)


def _validate_messages(messages: Sequence[Message]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"messages[{i}] must be a dict with a 'role', got {message!r}")
