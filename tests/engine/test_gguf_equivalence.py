"""A GGUF file serves the greedy tokens Hugging Face transformers generates from the same file.

transformers dequantizes a GGUF file on load (its own reader) and runs its own model code in
float32; carpool keeps the weights quantized (`models.quant`) and runs its own route with
float32 activations. For the four architectures, the types the `gguf` package writes itself
(llama.cpp's own converter and quantizer wrote the K-quant files: tests/fixtures/gguf), under
the default scheduler, chunked prefill with preemption, and static batching.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from carpool import LLM, SamplingParams
from carpool.testing.checkpoints import random_prompt
from carpool.testing.gguf_writer import write_gguf
from tests.engine.conftest import SEPARATED

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
# transformers' GGUF reader ignores a qwen3 file's key_length and takes Qwen3's default head
# dimension, 128 (every released Qwen3's): the qwen3 checkpoint has it.
OVERRIDES = {"qwen3": dict(head_dim=128)}
PROMPT_LENGTHS = (1, 3, 17, 64, 150)
OUTPUT_LENGTHS = (24, 9, 24, 16, 12)
SETTINGS = {
    "default": dict(num_kv_blocks=256),
    # 24-token chunks beside decodes, and a pool small enough that growth preempts.
    "chunked_preemption": dict(num_kv_blocks=44, block_size=4, max_num_batched_tokens=24),
    "static": dict(num_kv_blocks=256, scheduler="static", max_num_seqs=4),
}


@pytest.fixture(scope="module")
def gguf_file(make_checkpoint, tmp_path_factory):
    """gguf_file(arch, qtype) -> a GGUF file of the arch's separated checkpoint, cached."""
    cache = {}

    def make(arch: str, qtype: str):
        if (arch, qtype) not in cache:
            out = tmp_path_factory.mktemp(f"gguf_{arch}") / f"{arch}-{qtype}.gguf"
            checkpoint = make_checkpoint(arch, **SEPARATED, **OVERRIDES.get(arch, {}))
            cache[arch, qtype] = write_gguf(checkpoint, out, qtype)
        return cache[arch, qtype]
    return make


@pytest.fixture(scope="module")
def hf_gguf_greedy():
    """hf_gguf_greedy(file, prompt_ids, n) -> transformers' greedy tokens from the GGUF file."""
    from transformers import AutoModelForCausalLM

    models = {}

    def generate(file, prompt_ids, max_new_tokens):
        if file not in models:
            models[file] = AutoModelForCausalLM.from_pretrained(
                str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = models[file].generate(ids, attention_mask=torch.ones_like(ids),
                                        do_sample=False, max_new_tokens=max_new_tokens)
        return out[0, len(prompt_ids):].tolist()
    return generate


def workload():
    rng = random.Random(99)
    return [(random_prompt(rng, n), m) for n, m in zip(PROMPT_LENGTHS, OUTPUT_LENGTHS)]


CASES = [(arch, qtype, "default") for arch in ARCHS for qtype in ("Q8_0", "Q5_0", "Q4_0", "F16")] + [
    (arch, "Q4_0", setting) for arch in ARCHS for setting in ("chunked_preemption", "static")]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"


@pytest.mark.parametrize(("arch", "qtype", "setting"), CASES)
def test_gguf_greedy_matches_transformers(arch, qtype, setting, gguf_file, hf_gguf_greedy):
    file = gguf_file(arch, qtype)
    prompts = workload()
    references = [hf_gguf_greedy(file, ids, n) for ids, n in prompts]
    llm = LLM(str(file), dtype="float32", **SETTINGS[setting])
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in prompts],
                        [SamplingParams(max_tokens=n, temperature=0) for _, n in prompts],
                        use_tqdm=False)
    for (ids, n), ref, out in zip(prompts, references, outs):
        assert list(out.outputs[0].token_ids) == ref, (
            f"{arch} {qtype} {setting}: prompt of {len(ids)} tokens")
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert (stats.num_preemptions > 0) == (setting == "chunked_preemption")


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_k_quant_file_matches_transformers(arch, setting, hf_gguf_greedy):
    """Q4_K_M files written by llama.cpp's own converter and quantizer (Q4_K and Q6_K tensors,
    tests/fixtures/gguf/README.md)."""
    file = FIXTURES / f"tiny-{arch}-Q4_K_M.gguf"
    prompts = workload()
    references = [hf_gguf_greedy(file, ids, n) for ids, n in prompts]
    llm = LLM(str(file), dtype="float32", **SETTINGS[setting])
    kinds = {k for m in llm.engine.runner.model.modules() for k in getattr(m, "kinds", list)()}
    assert {"Q4_K", "Q6_K"} <= kinds
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in prompts],
                        [SamplingParams(max_tokens=n, temperature=0) for _, n in prompts],
                        use_tqdm=False)
    for (ids, _), ref, out in zip(prompts, references, outs):
        assert list(out.outputs[0].token_ids) == ref, f"{arch} {setting}: {len(ids)} tokens"
    assert (llm.stats().num_preemptions > 0) == (setting == "chunked_preemption")
