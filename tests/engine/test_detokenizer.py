"""Incremental detokenization: deltas add up to the full decode, never split a
character, never leak any part of a stop string."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from carpool.engine.detokenizer import (IncrementalDetokenizer, TokenTextCache,
                                        find_stop_string, longest_stop_prefix_suffix)
from carpool.engine.tokenizer import encode_chat, load_tokenizer
from carpool.outputs import Logprob
from carpool.sampling_params import SamplingParams

TEXTS = [
    "def foo(x):\n    return x + 1",
    "héllo wörld 日本語 👍🏽 done",
    "    # comment with  two  spaces and a tab\t!",
    "über naïve café — “quotes” ✓",
]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def stream(tokenizer, prompt_ids, output_ids, params, finish=True):
    """Feed tokens one at a time; return the deltas and the stop string, if any."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    deltas = []
    for i, token_id in enumerate(output_ids):
        last = finish and i == len(output_ids) - 1
        delta = detok.update([token_id], finished=last)
        deltas.append(delta.text)
        if delta.stop_string is not None:
            return deltas, delta.stop_string
    return deltas, None


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_full_decode_and_never_split_a_character(tokenizer, text):
    prompt = tokenizer.encode("x = 1\n")
    output = tokenizer.encode(text)
    deltas, stop = stream(tokenizer, prompt, output, SamplingParams())
    assert stop is None
    assert "".join(deltas) == tokenizer.decode(output) == text
    assert not any("\ufffd" in d for d in deltas)
    # Multi-byte characters span several byte-level tokens: some deltas were held back.
    if any(ord(c) > 127 for c in text):
        assert "" in deltas


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=40), prompt=st.text(max_size=10))
def test_any_text_round_trips(tokenizer, text, prompt):
    prompt_ids = tokenizer.encode(prompt) or [tokenizer.eos_token_id]
    output = tokenizer.encode(text)
    deltas, _ = stream(tokenizer, prompt_ids, output, SamplingParams())
    assert "".join(deltas) == tokenizer.decode(output, skip_special_tokens=True)


def test_trailing_partial_character_is_flushed_on_finish(tokenizer):
    output = tokenizer.encode("ab日")[:-1]  # cut inside the 3-byte character
    deltas, _ = stream(tokenizer, [1], output, SamplingParams(), finish=False)
    assert "\ufffd" not in "".join(deltas)
    deltas, _ = stream(tokenizer, [1], output, SamplingParams(), finish=True)
    assert "".join(deltas) == tokenizer.decode(output)


def test_prompt_ending_mid_character_does_not_swallow_output_bytes(tokenizer):
    prompt = tokenizer.encode("ab日")[:-1]  # the prompt's last character is cut short
    assert tokenizer.decode(prompt).endswith("\ufffd")
    continuation = tokenizer.encode("日")  # its first token is a continuation byte
    output = continuation[-1:] + tokenizer.encode(" x = 1")
    deltas, _ = stream(tokenizer, prompt, output, SamplingParams())
    assert "".join(deltas) == tokenizer.decode(output)


def test_special_tokens_are_skipped_or_kept(tokenizer):
    output = tokenizer.encode("hi") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    skipped, _ = stream(tokenizer, [1], output, SamplingParams())
    kept, _ = stream(tokenizer, [1], output, SamplingParams(skip_special_tokens=False))
    assert "".join(skipped) == "hi"
    assert "".join(kept) == "hi<|im_end|>"


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["return", "x + 1", "\n", ")", "wörld 日"])
def test_stop_string_cuts_text_and_is_never_leaked(tokenizer, stop, include):
    text = "def foo(x):\n    return x + 1 # héllo wörld 日本語"
    output = tokenizer.encode(text)
    params = SamplingParams(stop=(stop, "never-there"), include_stop_str_in_output=include)
    deltas, found = stream(tokenizer, [1], output, params)
    assert found == stop
    cut = text.index(stop) + (len(stop) if include else 0)
    assert "".join(deltas) == text[:cut]
    # Before the last delta no emitted text ever held the start of the stop string
    # at a position where the stop string later appears.
    assert stop not in "".join(deltas[:-1])
    assert len("".join(deltas[:-1])) <= text.index(stop)


def test_stop_string_split_across_many_tokens_is_held_back(tokenizer):
    text = "aaaa STOP_HERE bbbb"
    output = tokenizer.encode(text)
    params = SamplingParams(stop=("STOP_HERE",))
    deltas, found = stream(tokenizer, [1], output, params)
    assert found == "STOP_HERE"
    assert "".join(deltas) == "aaaa "
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert "S" not in emitted  # the stop's first character was held back from the start


def test_held_back_prefix_is_flushed_when_request_ends_otherwise(tokenizer):
    output = tokenizer.encode("abc STO")
    deltas, found = stream(tokenizer, [1], output, SamplingParams(stop=("STOP",)))
    assert found is None
    assert "".join(deltas) == "abc STO"
    assert "".join(deltas[:-1]) in ("abc", "abc ")  # "STO" held until the last step


def test_stop_strings_are_ignored_before_min_tokens(tokenizer):
    output = tokenizer.encode("a, b, c, d")
    assert tokenizer.convert_ids_to_tokens(output)[:4] == ["a", ",", "Ġb", ","]
    # The comma in token 2 comes before min_tokens=3 outputs; the one in token 4 stops.
    params = SamplingParams(stop=(",",), min_tokens=3, max_tokens=16)
    deltas, found = stream(tokenizer, [1], output, params)
    assert found == "," and len(deltas) == 4
    assert "".join(deltas) == "a, b"


def test_find_stop_string_takes_the_one_that_completes_first():
    assert find_stop_string("xxabcd", ["bcd", "abc"]) == (2, "abc")
    assert find_stop_string("xxabcd", ["cd", "bcd"]) == (3, "bcd")
    assert find_stop_string("xyz", ["a"]) is None


def test_longest_stop_prefix_suffix():
    assert longest_stop_prefix_suffix("hello wo", ["world"]) == 2
    assert longest_stop_prefix_suffix("hello w", ["xx", "world"]) == 1
    assert longest_stop_prefix_suffix("hello", ["world"]) == 0
    assert longest_stop_prefix_suffix("ab", ["abc", "b"]) == 2


def test_window_stays_small_on_long_outputs(tokenizer):
    """O(new tokens) per step: the ids kept never grow with the output."""
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], SamplingParams())
    output = tokenizer.encode("def f(x):\n    return x\n" * 100)
    text = "".join(detok.update([t], finished=False).text for t in output)
    assert text == tokenizer.decode(output)
    assert len(detok._ids) < 100


def test_token_text_cache_fills_decoded_tokens(tokenizer):
    cache = TokenTextCache(tokenizer)
    ids = tokenizer.encode("return")
    position = {ids[0]: Logprob(-0.5, rank=1), 0: Logprob(-3.0, rank=2)}
    cache.fill(position)
    assert position[ids[0]].decoded_token == tokenizer.decode([ids[0]])
    assert position[0].decoded_token == "<|endoftext|>"


def test_chat_template_renders_generation_prompt(tokenizer):
    ids = encode_chat(tokenizer, [{"role": "user", "content": "hi"}])
    assert tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="messages"):
        encode_chat(tokenizer, [])


def test_longest_stop_prefix_suffix_matches_brute_force():
    import random

    def brute(text, stops):
        return max((n for n in range(1, len(text) + 1) for s in stops
                    if n < len(s) and s.startswith(text[len(text) - n:])), default=0)

    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 8)))
                 for _ in range(rng.randint(1, 4))]
        assert longest_stop_prefix_suffix(text, stops) == brute(text, stops), (text, stops)


def test_stop_scan_at_the_caps_stays_cheap():
    """The caps bound a step's scan: 64 stop strings of 128 characters (8192 in all) against
    the worst text for the held-back scan, where every first-character occurrence is a
    candidate that fails on its second character (~8k C-level comparisons, ~2 ms here)."""
    import time
    stops = ["ab" * 63 + "a" + chr(0x100 + i) for i in range(64)]
    text = "a" * 1200
    start = time.perf_counter()
    for _ in range(10):
        assert longest_stop_prefix_suffix(text, stops) == 1
        assert find_stop_string(text, stops) is None
    assert (time.perf_counter() - start) / 10 < 0.02


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_decoder_is_the_tokenizers_decode(tokenizer, skip_special_tokens):
    # The Rust shortcut the detokenizer takes must return exactly what transformers' does,
    # special tokens, split characters and all.
    from carpool.engine.tokenizer import text_decoder

    decode = text_decoder(tokenizer)
    specials = [i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id) if i is not None]
    for text in TEXTS:
        ids = specials + tokenizer.encode(text, add_special_tokens=False) + specials
        for end in range(len(ids) + 1):
            assert decode(ids[:end], skip_special_tokens) == tokenizer.decode(
                ids[:end], skip_special_tokens=skip_special_tokens)
