"""Attention backends: how keys and values are written to the paged cache and attended.

A backend builds its per-step metadata once, from the step's packed layout, and
every layer reads it unchanged. `cpu` holds the CPU-specific fast paths; `sdpa`
is portable PyTorch and what CUDA runs.
"""
