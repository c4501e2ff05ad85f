"""Grammar-constrained decoding: JSON schemas, regexes, choices and grammars, with llguidance.

`grammar` turns a request's `StructuredOutputsParams` into llguidance's grammar text and
checks it; `compiler.GrammarCompiler` compiles it once per distinct grammar (a bounded cache)
against the model's tokenizer and hands each request its own matcher; `bitmask` computes the
allowed-token bitmask of a step's constrained rows on a helper thread while the model runs.
The engine keeps one matcher per request and advances it with every sampled token; the
runner's sampler applies the bitmask to those rows only.
"""
