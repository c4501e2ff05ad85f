"""Batch-invariant mode holds with quantized weights: a request's logprobs and seeded samples
from a GGUF file are bitwise the same alone and in a batch of 40 (chunked, cached)."""

from __future__ import annotations

import pytest

from carpool import LLM
from carpool.testing.gguf_writer import write_gguf
from tests.engine.test_batch_invariance import NUM_PROMPTS, alone, assert_same, kernels, \
    prompts_of, run

__all__ = ["kernels"]  # the fixture, imported for pytest


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_0"])
def test_quantized_alone_equals_batched(kernels, make_checkpoint, tmp_path, qtype, dtype):
    file = write_gguf(make_checkpoint("qwen2"), tmp_path / f"qwen2-{qtype}.gguf", qtype)
    prompts = prompts_of(7)
    with LLM(str(file), dtype=dtype, batch_invariant=True,
             max_num_batched_tokens=64) as llm:
        reference = alone(llm, prompts)
        assert_same(reference, run(llm, prompts, range(NUM_PROMPTS)), "batch of 40")
        assert_same(reference, run(llm, prompts, range(NUM_PROMPTS)), "cached batch of 40")
