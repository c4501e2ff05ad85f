"""Fixtures for runner tests: a runner factory and fixed prompts."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def make_runner():
    from carpool.config import EngineConfig
    from carpool.distributed import SINGLE
    from carpool.runner.model_runner import ModelRunner

    def make(path, *, platform=None, tp=SINGLE, **kwargs):
        """A runner of the model in `path`; `kwargs` are `EngineConfig.from_args`'s (LLM's)."""
        settings = dict(max_model_len=512, max_num_batched_tokens=256, max_num_seqs=8,
                        num_kv_blocks=96, block_size=4, device="cpu",
                        dtype="float32")  # the HF references are float32
        settings.update(kwargs)
        config = EngineConfig.from_args(str(path), **settings)
        return ModelRunner(config, path, platform=platform, tp=tp)

    return make


@pytest.fixture
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (37, 5, 70)]
