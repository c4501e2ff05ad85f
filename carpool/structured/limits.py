"""A grammar's size measured before llguidance sees it, against the server's `GrammarLimits`.

llguidance bounds none of it: a chain of a few thousand Lark rules (or a thousand JSON
schema `$ref`s) overflows its stack and kills the process, and its time grows faster than
the text (a 100,000-way choice takes seconds to check, then fails to compile). Measuring is
plain Python over the text, linear and cheap; the error names the client's field, what is
over, the limit and its flag.

The measures are an upper bound of what the library will build, not a parse: rules are the
lines that define one, depth the nesting of brackets outside string literals, alternatives
the `|`s outside them (a GBNF character class `[...]` counts as one atom).
"""

from __future__ import annotations

import json
import re

from carpool.sampling_params import FLAGS_OF_LIMITS, GrammarLimits, StructuredOutputsParams

# A Lark rule or terminal (`name:`, `?name:`, `NAME.2:`) or a GBNF rule (`name ::=`).
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*[ \t]*(?:::=|:)", re.MULTILINE)
# What the bracket scan of a grammar steps over whole: string literals, Lark /regex/ terminals,
# GBNF character classes, comments.
_GRAMMAR_ATOM = re.compile(r'"(?:\\.|[^"\\])*"|/(?:\\.|[^/\\\n])+/[imslux]*'
                           r"|\[(?:\\.|[^\]\\\n])*\]|(?://|#)[^\n]*")
# A regex's escapes and character classes, stepped over by the same scan.
_REGEX_ATOM = re.compile(r"\\.|\[\^?\]?(?:\\.|[^\]\\])*\]")
_JSON_ALTERNATIVES = ("enum", "anyOf", "oneOf", "allOf")


def check_limits(params: StructuredOutputsParams, limits: GrammarLimits,
                 field: str = "structured_outputs") -> None:
    """ValueError naming `field` when the grammar of `params` is over one of `limits`."""
    kind = params.kind
    if kind == "json_object":
        return
    value = getattr(params, kind)
    if kind == "choice":
        _at_most(field, "choice list", "choices", len(value), limits, "max_alternatives")
        num_bytes = sum(len(c.encode("utf-8", "surrogatepass")) for c in value)
    else:
        num_bytes = len(value.encode("utf-8", "surrogatepass"))
    _at_most(field, NOUNS[kind], "bytes", num_bytes, limits, "max_bytes")
    if kind == "json":
        rules, depth, alternatives = _json_measures(value, field, limits)
    elif kind == "choice":
        return
    else:
        text = value
        if kind == "grammar":
            rules = len(_RULE.findall(text))
            text = _GRAMMAR_ATOM.sub("a", text)
        else:
            rules = 0
            text = _REGEX_ATOM.sub("a", text)
        depth, alternatives = _bracket_depth(text), text.count("|") + 1
    _at_most(field, NOUNS[kind], "rules" if kind == "grammar" else "$refs", rules, limits,
             "max_rules")
    _at_most(field, NOUNS[kind], "levels of nesting", depth, limits, "max_depth")
    _at_most(field, NOUNS[kind], "alternatives", alternatives, limits, "max_alternatives")


NOUNS = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
         "grammar": "grammar", "choice": "choice list"}


def _at_most(field: str, noun: str, unit: str, count: int, limits: GrammarLimits,
             name: str) -> None:
    limit = getattr(limits, name)
    if count > limit:
        flag = "--" + FLAGS_OF_LIMITS[name].replace("_", "-")
        raise ValueError(f"{field}: the {noun} has {count} {unit}, more than this server's "
                         f"limit of {limit} ({flag})")


def _bracket_depth(text: str) -> int:
    depth = deepest = 0
    for char in text:
        if char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}" and depth:
            depth -= 1
    return deepest


def _json_measures(text: str, field: str, limits: GrammarLimits) -> tuple[int, int, int]:
    """($refs, nesting depth, enum/anyOf/oneOf/allOf items) of a JSON schema's text."""
    depth = _bracket_depth(re.sub(r'"(?:\\.|[^"\\])*"', '""', text))
    _at_most(field, "JSON schema", "levels of nesting", depth, limits, "max_depth")
    try:  # nesting bounded above, so the decoder's recursion is too
        schema = json.loads(text)
    except json.JSONDecodeError:
        return 0, depth, 0  # the grammar's own check names what is wrong
    refs = alternatives = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            refs += "$ref" in node
            alternatives += sum(len(node[k]) for k in _JSON_ALTERNATIVES
                                if isinstance(node.get(k), list))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return refs, depth, alternatives
