"""Helpers for comparing carpool's network with Hugging Face's on the same checkpoint."""

from __future__ import annotations

import pytest
import torch


def _carpool_logits(model, prompt: list[int], chunk: int, block_size: int = 4) -> torch.Tensor:
    """Logits [len(prompt), V] from carpool's model, prefilling `prompt` in chunks of `chunk`.

    Blocks are handed out in reverse order so the block table is not the identity.
    """
    from carpool.attention import AttentionShape, create_backend
    from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput
    from carpool.runner import kv_cache
    from carpool.runner.input_batch import build_input_batch
    from carpool.sampling_params import SamplingParams

    config = model.config
    dtype = model.lm_head.weight.dtype
    num_blocks = -(-len(prompt) // block_size) + 2
    spec = kv_cache.KVCacheSpec.from_model(config, block_size, dtype)
    cpu = torch.device("cpu")
    backend = create_backend("auto", AttentionShape(config.num_heads, config.num_kv_heads,
                                                    config.head_dim, config.sliding_window), cpu)
    caches = kv_cache.allocate_kv_caches(spec, num_blocks, cpu, backend)
    blocks = list(reversed(range(num_blocks)))
    rows = []
    with torch.inference_mode():
        for start in range(0, len(prompt), chunk):
            ids = prompt[start:start + chunk]
            req = ScheduledRequest("r", ids, start, blocks, True, SamplingParams())
            batch = build_input_batch(SchedulerOutput([req]), block_size=block_size,
                                      scratch_block=num_blocks, device=cpu)
            hidden = model(batch.input_ids, batch.positions, caches, backend,
                           backend.build_metadata(batch.layout))
            rows.append(model.compute_logits(hidden))
    return torch.cat(rows)


def _hf_logits(path, prompt: list[int], dtype=torch.float32) -> torch.Tensor:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


@pytest.fixture
def prompt() -> list[int]:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(1, 512, (150,), generator=gen).tolist()


@pytest.fixture
def carpool_logits():
    return _carpool_logits


@pytest.fixture
def hf_logits():
    return _hf_logits
