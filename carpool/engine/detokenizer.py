"""Token ids -> text deltas, one request at a time, outside the model step.

Each step decodes only a small window of recent tokens, so the cost is
O(new tokens), never O(context) (the offsets scheme of HF's TextStreamer and
vLLM):

    ids:  ... | prefix_offset ........ read_offset ......... len(ids)
                |<- already emitted ->|<- not yet emitted ->|

    new text = decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])

A delta is held back while the decoded window ends with U+FFFD (a UTF-8
character split across tokens), and while the text ends with the start of a
stop string (the longest such suffix), so a client never sees a stop string
or half a character. When a stop string appears the text is cut there.

Stop strings are searched only in the held-back text plus this step's new text
(at most the longest stop string minus one, plus the delta), never the whole
output. With `SamplingParams`' caps (64 strings, 8192 characters in all) one
step costs at most one `str.find` per stop string over that window, and for the
held-back suffix at most one C-level prefix comparison per occurrence of a stop
string's first character in its last len(stop) - 1 characters: in all at most
8192 comparisons (about 2 ms of Python for text built to defeat the scan, tens
of microseconds for ordinary text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from carpool.engine.tokenizer import text_decoder
from carpool.outputs import PositionLogprobs
from carpool.sampling_params import SamplingParams

# Prompt tokens decoded as context before the first output token, so the first
# output token's text (a leading space, a merged byte) comes out right.
NUM_CONTEXT_TOKENS = 5
# Emitted ids beyond this many are dropped from the window's list, bounding its memory.
_MAX_STALE_IDS = 64
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class TextDelta:
    text: str  # new text to send; "" while held back
    stop_string: str | None = None  # the stop string that ended the request, if one did
    # With a stop string among several new tokens (speculative decoding): how many of them
    # reached it; the request's output ends there. None: all of them.
    num_tokens: int | None = None


class IncrementalDetokenizer:
    """The text state of one request: a window of ids, offsets, and held-back text."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams):
        self._decode_ids = text_decoder(tokenizer)
        self._skip_special_tokens = params.skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        if self._decode(self._ids).endswith(_REPLACEMENT_CHAR):
            # The prompt ends mid-character: its context would swallow the output's first
            # bytes. Decode the output on its own, as decode(output_ids) would.
            self._ids = []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_output_tokens = 0
        self._held = ""  # decoded text not sent yet: it may be the start of a stop string

    def update(self, new_token_ids: Sequence[int], finished: bool) -> TextDelta:
        """Take this step's new tokens; return the text that may be sent now.

        With `finished` (the request ended for another reason), everything held
        back is flushed, even a trailing partial character. Once a stop string
        is returned the request is over; later calls are not expected. Several tokens with
        stop strings are taken one at a time, so a stop string ends the output at the token
        that completed it, as when each came in its own step (`TextDelta.num_tokens`).
        """
        if len(new_token_ids) > 1 and self._stops:
            texts = []
            for i, token_id in enumerate(new_token_ids):
                last = i == len(new_token_ids) - 1
                delta = self.update((token_id,), finished=finished and last)
                texts.append(delta.text)
                if delta.stop_string is not None:
                    return TextDelta("".join(texts), delta.stop_string,
                                     None if last else i + 1)
            return TextDelta("".join(texts))
        self._ids.extend(new_token_ids)
        self._num_output_tokens += len(new_token_ids)
        text = self._decode_new_text(flush=finished)
        if not self._stops:
            return TextDelta(text)
        text = self._held + text
        self._held = ""
        if self._num_output_tokens > self._min_tokens:
            match = find_stop_string(text, self._stops)
            if match is not None:
                start, stop = match
                end = start + len(stop) if self._include_stop else start
                return TextDelta(text[:end], stop_string=stop)
        if not finished:
            num_held = longest_stop_prefix_suffix(text, self._stops)
            self._held = text[len(text) - num_held:]
            text = text[:len(text) - num_held]
        return TextDelta(text)

    def _decode_new_text(self, flush: bool) -> str:
        """Text of ids[read_offset:], decoded in context; "" while it ends mid-character."""
        if self._read_offset == len(self._ids):
            return ""
        window = self._ids[self._prefix_offset:]
        prefix_text = self._decode(window[:self._read_offset - self._prefix_offset])
        full_text = self._decode(window)
        if len(full_text) <= len(prefix_text) and not flush:
            return ""  # e.g. only skipped special tokens so far
        if full_text.endswith(_REPLACEMENT_CHAR) and not flush:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._prefix_offset > _MAX_STALE_IDS:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return full_text[len(prefix_text):]

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, self._skip_special_tokens)


def find_stop_string(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop) of the stop string that completes first in `text`, or None.

    "First" is by end position, then start: the one a reader would have seen complete first.
    """
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0:
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
    return None if best is None else (best[1], best[2])


def longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string.

    That many characters must be held back: the next token may complete the stop string.
    Only suffixes starting at an occurrence of the stop's first character are compared.
    """
    best = 0
    for stop in stops:
        tail = text[max(len(text) - len(stop) + 1, 0):]  # proper prefixes only
        start = tail.find(stop[0])
        while 0 <= start and len(tail) - start > best:
            if stop.startswith(tail[start:]):
                best = len(tail) - start
                break
            start = tail.find(stop[0], start + 1)
    return best


class TokenTextCache:
    """Text of single token ids, for `Logprob.decoded_token`; cached, as the vocabulary is fixed."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text

    def fill(self, position: PositionLogprobs) -> PositionLogprobs:
        """Set `decoded_token` on every Logprob of one output position (in place)."""
        for token_id, logprob in position.items():
            if logprob.decoded_token is None:
                logprob.decoded_token = self.text(token_id)
        return position
