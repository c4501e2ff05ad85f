"""A text far longer than the context is refused after tokenizing a prefix (issue 21, item 2):
a 4 MB prompt must not cost seconds of tokenizing before the length check refuses it."""

from __future__ import annotations

import pytest

from carpool.default_model_path import default_model_path
from carpool.engine.tokenizer import encode_bounded, encode_chat, encode_prompt, load_tokenizer


class RecordingTokenizer:
    """The real tokenizer, noting the length of every text it is asked to encode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def encode(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def test_a_huge_prompt_is_refused_after_tokenizing_a_prefix(tokenizer):
    spy = RecordingTokenizer(tokenizer)
    text = "hello world " * 200_000  # 2.4 MB, ~400k tokens
    with pytest.raises(ValueError, match="maximum context length is 512 tokens"):
        encode_prompt(spy, text, max_tokens=512)
    assert max(spy.lengths) < len(text) / 100, spy.lengths


def test_a_huge_chat_message_is_refused_after_tokenizing_a_prefix(tokenizer):
    spy = RecordingTokenizer(tokenizer)
    content = "hello world " * 200_000
    with pytest.raises(ValueError, match="maximum context length is 512 tokens"):
        encode_chat(spy, [{"role": "user", "content": content}], max_tokens=512)
    assert max(spy.lengths) < len(content) / 100, spy.lengths


@pytest.mark.parametrize("text", [
    " " * 40_000 + "x",           # ~31 characters a token: longer than the first prefix, fits
    "hello world " * 30,          # shorter than the first prefix
    "def f(x):\n    return x\n" * 40,  # near the bound: not refused early
])
def test_a_text_not_surely_too_long_gets_exactly_the_tokenizers_ids(tokenizer, text):
    for add_special_tokens in (True, False):
        expected = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        assert encode_bounded(tokenizer, text, add_special_tokens=add_special_tokens,
                              max_tokens=max(len(expected) - 1, 1)) == expected
        assert encode_bounded(tokenizer, text, add_special_tokens=add_special_tokens,
                              max_tokens=None) == expected
