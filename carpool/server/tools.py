"""Tool calling: which calls a request may make, the grammar that forces them, and reading them.

`tool_choice`:
- `none`: the tools are rendered into the prompt, the output is plain text;
- `auto`: the model decides; its own call format is read back by the `--tool-call-parser`
  (only with `--enable-auto-tool-choice`, as vLLM);
- `required`: the output is constrained to a JSON array of `{"name", "parameters"}`, one
  per call (at most one unless `parallel_tool_calls`), each against its function's schema;
- a named function: the output is constrained to that function's parameter schema, and is
  the call's arguments.
Either forced form is parsed here, whatever the model's own format, since the grammar
fixed it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from carpool.sampling_params import StructuredOutputsParams

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self, index: int | None = None) -> dict:
        """OpenAI's `tool_calls` entry (with `index`: a streamed delta's)."""
        body = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return body if index is None else {"index": index, **body}


@dataclass(frozen=True)
class ToolChoice:
    """What the request allows: mode `none`, `auto`, `required` or `named` (+ `name`)."""

    mode: str
    tools: tuple[dict, ...] = ()  # the functions ({"name", "description", "parameters"})
    name: str | None = None
    parallel: bool = True

    def grammar(self) -> StructuredOutputsParams | None:
        """The constraint a forced choice puts on the output; None for none and auto."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self._parameters(self.name))
        if self.mode != "required":
            return None
        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "parameters"],
                  "properties": {"name": {"const": t["name"]},
                                 "parameters": t.get("parameters") or ANY_OBJECT}}
                 for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def _parameters(self, name: str) -> dict:
        return next(t.get("parameters") or ANY_OBJECT for t in self.tools if t["name"] == name)

    def forced_calls(self, text: str) -> list[ToolCall]:
        """The calls of a finished forced output (empty if it is not complete JSON)."""
        if self.mode == "named":
            return [ToolCall(self.name, text)]
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:
            return []
        return [ToolCall(c["name"], json.dumps(c["parameters"])) for c in calls]


def tool_choice_of(tools: list[dict] | None, tool_choice: Any, parallel: bool,
                   auto_enabled: bool) -> ToolChoice:
    """Check `tools` and `tool_choice` (ValueError naming the field) and say what they allow."""
    functions = tuple(_function(i, t) for i, t in enumerate(tools or ()))
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}")
        if name not in {f["name"] for f in functions}:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        return ToolChoice("named", functions, name, parallel)
    if tool_choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a named function, "
                         f"got {tool_choice!r}")
    if tool_choice != "none" and not functions:
        raise ValueError(f"tool_choice {tool_choice!r} needs tools")
    if tool_choice == "auto" and not auto_enabled:
        raise ValueError('tool_choice "auto" needs the server started with '
                         "--enable-auto-tool-choice and --tool-call-parser")
    return ToolChoice(tool_choice, functions, None, parallel)


def _function(index: int, tool: Any) -> dict:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
            function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"tools[{index}] must be {{'type': 'function', 'function': "
                         f"{{'name': ..., 'parameters': ...}}}}")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ValueError(f"tools[{index}].function.parameters must be a JSON schema object")
    return function
