"""One chat choice's output as content and tool calls, whole or while it streams.

Forced calls (`required`, a named function) come from the grammar-shaped JSON; `auto`
calls from the `--tool-call-parser`. Streaming follows OpenAI's shape: a named call's
arguments are sent as they are generated (the first delta carries id, type and name);
other calls are sent whole, one `tool_calls` delta when the choice ends, while `auto`
streams the plain text before them as content (holding back what may start a call).
A choice that made calls and ended on its own finishes with `tool_calls`.
"""

from __future__ import annotations

from carpool.server.tool_parsers import ToolParser
from carpool.server.tools import ToolCall, ToolChoice


class ToolOutput:
    def __init__(self, choice: ToolChoice, parser: ToolParser | None) -> None:
        self.choice = choice
        self.parser = parser
        self._text = ""
        self._num_sent = 0  # characters of _text already streamed as content
        self._in_calls = False
        self._named_call: ToolCall | None = None

    # -- whole responses ----------------------------------------------------------------

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The `message` of a finished choice, and its finish reason."""
        content, calls = self._split(text, finish_reason)
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.as_dict() for call in calls]
        return message, _finish_reason(calls, finish_reason)

    def _split(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall]]:
        if self.choice.mode == "named":
            return None, self.choice.forced_calls(text)
        if self.choice.mode == "required":
            calls = self.choice.forced_calls(text) if finish_reason == "stop" else []
            return (None if calls else text), calls
        return self.parser.extract(text)

    # -- streaming ----------------------------------------------------------------------

    def feed(self, new_text: str) -> list[dict]:
        """The deltas to send for the choice's new text."""
        self._text += new_text
        if self.choice.mode == "named":
            return self._named_delta(new_text) if new_text else []
        if self.choice.mode == "required" or self._in_calls:
            return []
        start = self.parser.call_start(self._text)
        if start is not None:
            self._in_calls = True
            return self._content_until(start)
        return self._content_until(len(self._text) - self.parser.undecided(self._text))

    def finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """The last deltas of a finished choice, and its finish reason."""
        if self.choice.mode == "named":
            deltas = [] if self._named_call else self._named_delta("")
            return deltas, _finish_reason([self._named_call], finish_reason)
        content, calls = self._split(self._text, finish_reason)
        if not calls:
            return self._content_until(len(self._text)), finish_reason
        deltas = self._content_until(self._num_sent) + [
            {"tool_calls": [call.as_dict(i) for i, call in enumerate(calls)]}]
        return deltas, _finish_reason(calls, finish_reason)

    def _named_delta(self, arguments: str) -> list[dict]:
        if self._named_call is None:
            self._named_call = ToolCall(self.choice.name, "")
            first = self._named_call.as_dict(0)
            first["function"]["arguments"] = arguments
            return [{"tool_calls": [first]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": arguments}}]}]

    def _content_until(self, end: int) -> list[dict]:
        if end <= self._num_sent:
            return []
        text, self._num_sent = self._text[self._num_sent:end], end
        return [{"content": text}]


def _finish_reason(calls: list, finish_reason: str | None) -> str | None:
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason
