"""Tensor-free scheduling core: requests, KV block accounting, schedulers.

Nothing in this package imports torch (a test enforces it), so policy can be
tested by the thousand and driven by the simulator without a model.
"""
