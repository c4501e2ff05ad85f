"""The step loop (LLMEngine), its tokenizer and the incremental detokenizer."""
