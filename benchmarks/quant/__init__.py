"""GGUF fixtures and llama.cpp reference figures for carpool's quantized-weight support."""
