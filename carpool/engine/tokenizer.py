"""The model's own tokenizer and chat template, loaded from its folder with transformers.

Only `AutoTokenizer` is used from transformers here: text <-> token ids and the
chat template. transformers' model code is never in the serving path.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# A chat message as the OpenAI API and the templates see it: {"role": ..., "content": ...}.
Message = dict[str, Any]


def load_tokenizer(model_path: str | os.PathLike, chat_template: str | None = None):
    """Load the tokenizer saved beside the weights (`tokenizer.json` / `tokenizer_config.json`),
    with `chat_template` (the template text) in place of its own when given.

    Raises FileNotFoundError naming the folder when it holds no tokenizer files.
    """
    from transformers import AutoTokenizer

    path = Path(model_path)
    if path.is_dir() and not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer in model folder {path} (expected one of {', '.join(_TOKENIZER_FILES)})")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    logger.info("tokenizer %s: %d tokens, eos %r", type(tokenizer).__name__, len(tokenizer),
                tokenizer.eos_token)
    return tokenizer


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of a plain-text prompt, with the special tokens (BOS) the tokenizer adds."""
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    return list(tokenizer.encode(prompt, add_special_tokens=True))


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


def encode_chat(tokenizer, messages: Sequence[Message], **kwargs) -> list[int]:
    """Token ids of the rendered conversation; the template already holds any BOS it wants."""
    text = render_chat(tokenizer, messages, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _validate_messages(messages: Sequence[Message]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"messages[{i}] must be a dict with a 'role', got {message!r}")
