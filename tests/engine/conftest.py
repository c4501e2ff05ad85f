"""Fixtures for the engine tests: tiny well-separated checkpoints and cached HF references."""

from __future__ import annotations

import pytest
import torch

# One torch thread: on a 2-core machine shared with other jobs, OpenMP threads spin
# against each other and every small matmul of these tiny models slows ~10x.
torch.set_num_threads(1)

# Random tiny models have nearly flat logits; initializer_range=0.2 separates the top
# tokens enough (gaps >= 1e-4 on every reference position) for exact greedy comparisons.
SEPARATED = dict(initializer_range=0.2)
# Test models beyond the four architectures' tiny shapes: name -> (architecture, overrides).
VARIANTS = {"llama-head-dim-40": ("llama", dict(hidden_size=80, num_attention_heads=2,
                                                num_key_value_heads=1)),
            # A vocabulary two ranks cannot split evenly (tensor parallelism pads it).
            "llama-odd-vocab": ("llama", dict(vocab_size=515)),
            # A mixture of experts routing each token to 8 of 16 experts.
            "qwen3_moe-top8": ("qwen3_moe", dict(num_experts=16, num_experts_per_tok=8))}


@pytest.fixture(scope="session")
def separated_checkpoint(make_checkpoint):
    """make_checkpoint(arch) with logits separated enough for exact greedy comparisons;
    `arch` may also name one of VARIANTS."""
    def make(arch="llama"):
        arch, overrides = VARIANTS.get(arch, (arch, {}))
        return make_checkpoint(arch, **SEPARATED, **overrides)
    return make


@pytest.fixture(scope="session")
def hf_greedy(separated_checkpoint):
    """hf_greedy(arch, prompt_ids, max_new_tokens) -> new token ids from transformers'
    own greedy `generate`, one prompt at a time, float32; cached for the session."""
    import torch
    from transformers import AutoModelForCausalLM

    models: dict[str, object] = {}
    cache: dict[tuple, list[int]] = {}

    def generate(arch: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (arch, tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            if arch not in models:
                models[arch] = AutoModelForCausalLM.from_pretrained(
                    str(separated_checkpoint(arch)), dtype=torch.float32).eval()
            input_ids = torch.tensor([prompt_ids])
            with torch.no_grad():
                out = models[arch].generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                    max_new_tokens=max_new_tokens)
            cache[key] = out[0, len(prompt_ids):].tolist()
        return cache[key]

    return generate
