"""Quantized weights: one canonical form (`weight.QuantizedWeight`) that every quantized file
format converts to at load (`gguf_blocks` for GGUF's blocks), the modules that multiply by it
(`linear.QuantLinear`, `linear.QuantEmbedding`), GGUF files read whole (`gguf_file`), and
Hugging Face's AWQ / GPTQ / compressed-tensors checkpoints (`hf_config` detects the scheme,
`hf_formats` converts its tensors, `hf_loader` builds the model).

One form means one kernel per bit width and one place a platform swaps in its own multiply;
the formats differ only in how their bytes are unpacked, which happens once, at load.
"""
