"""Reading the model's own tool-call format back into calls (`tool_choice: auto`).

Chosen by `--tool-call-parser`:
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, after any
  plain text (Hermes, Qwen 2.5/3, and the built-in model's template);
- `llama3_json`: the whole output is one or more `{"name": ..., "parameters": {...}}`
  objects separated by `;`, optionally after `<|python_tag|>` (Llama 3.1+).
Text that does not parse as calls stays content: a model that meant to call and failed
shows what it wrote rather than a 500.
"""

from __future__ import annotations

import json
import re

from carpool.server.tools import ToolCall

PARSER_NAMES = ("hermes", "llama3_json")


class ToolParser:
    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; no calls when it holds none that parse."""
        raise NotImplementedError

    def call_start(self, text: str) -> int | None:
        """Where the calls begin in an output so far (None: not yet, maybe never)."""
        raise NotImplementedError

    def undecided(self, text: str) -> int:
        """How many trailing characters might still turn out to start a call (held back
        from the streamed content until they are decided)."""
        raise NotImplementedError


class HermesParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for block in self._BLOCK.findall(text[start:]):
            call = _call_of(block, "arguments")
            if call is None:
                return text, []
            calls.append(call)
        return text[:start].strip() or None, calls

    def call_start(self, text: str) -> int | None:
        start = text.find(self.START)
        return None if start < 0 else start

    def undecided(self, text: str) -> int:
        for size in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-size:]):
                return size
        return 0


class Llama3JsonParser(ToolParser):
    TAG = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):
            try:
                obj, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text, []
            call = _call_of(obj, "parameters", "arguments")
            if call is None:
                return text, []
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \n\t;":
                position += 1
        return None, calls

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(("{", self.TAG)):
            return len(text) - len(stripped)
        return None

    def undecided(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or self.TAG.startswith(stripped):
            return len(text)  # nothing but whitespace (or a partial tag) so far
        return 0


def get_parser(name: str) -> ToolParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    raise ValueError(f"tool_call_parser must be one of {', '.join(PARSER_NAMES)}, got {name!r}")


def _call_of(block: str | dict, *argument_keys: str) -> ToolCall | None:
    """A call from `{"name": ..., "<argument key>": {...}}` (text or decoded), else None."""
    if isinstance(block, str):
        try:
            block = json.loads(block)
        except json.JSONDecodeError:
            return None
    if not isinstance(block, dict) or not isinstance(block.get("name"), str):
        return None
    arguments = next((block[k] for k in argument_keys if k in block), {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return ToolCall(block["name"], arguments)
