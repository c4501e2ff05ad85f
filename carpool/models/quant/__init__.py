"""Quantized weights: one canonical form (`weight.QuantizedWeight`) that every quantized file
format converts to at load (`gguf_blocks` for GGUF's blocks), the modules that multiply by it
(`linear.QuantLinear`, `linear.QuantEmbedding`), and GGUF files read whole (`gguf_file`).

One form means one kernel per bit width and one place a platform swaps in its own multiply;
the formats differ only in how their bytes are unpacked, which happens once, at load.
"""
