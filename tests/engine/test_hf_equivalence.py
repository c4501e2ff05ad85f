"""carpool's greedy outputs equal Hugging Face transformers' own `generate`, token for token.

For each architecture, a dozen prompts of 1 to 333 tokens run through
transformers one at a time (float32, do_sample=False); carpool runs them all at
once, each several times with different max_tokens (greedy outputs are prefixes
of each other), under every scheduler setting below and both attention backends. HF's EOS handling is matched: both stop at
the checkpoint's EOS, which random models do emit now and then.
"""

from __future__ import annotations

import random

import pytest

from carpool import LLM, SamplingParams

from carpool.testing.checkpoints import random_prompt

# llama: head_dim 16; mistral: MQA; qwen2: tied embeddings; qwen3: head_dim 32 (not
# hidden / heads); the variant: head_dim 40 (not a power of two).
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "llama-head-dim-40")
PROMPT_LENGTHS = (1, 2, 3, 7, 15, 16, 17, 33, 64, 100, 200, 333)
OUTPUT_LENGTHS = (64, 1, 40, 5, 64, 2, 17, 33, 8, 64, 12, 3)
EOS_TOKEN_ID = 0  # the test tokenizer's <|endoftext|>

SETTINGS = {
    "default": dict(num_kv_blocks=256),
    # A 32-token budget: every prompt over 32 tokens is prefilled in chunks beside decodes.
    "chunked_prefill": dict(num_kv_blocks=256, max_num_batched_tokens=32, block_size=8),
    # 96 blocks of 4 tokens: the longest request alone needs 87, so the others' growth
    # preempts (4 preemptions on every arch).
    "preemption": dict(num_kv_blocks=96, block_size=4, max_num_batched_tokens=512),
    # Prefix caching is on in every other setting (each prompt is sent three times, so
    # later copies hit); the same preemption run without it.
    "preemption_no_prefix_caching": dict(num_kv_blocks=96, block_size=4,
                                         max_num_batched_tokens=512, enable_prefix_caching=False),
    # Beyond the four the issue names: several partial prefills at once (chunks capped at
    # 24 tokens), and continuous batching with prompts prefilled whole.
    "partial_prefills": dict(num_kv_blocks=256, max_num_batched_tokens=64,
                             max_num_partial_prefills=3, long_prefill_token_threshold=24),
    "unchunked": dict(num_kv_blocks=256, enable_chunked_prefill=False),
    # Request-level batches of 8, padded to their longest prompt.
    "static": dict(num_kv_blocks=256, scheduler="static", max_num_seqs=8),
}


def workload() -> list[tuple[list[int], int]]:
    """(prompt ids, HF max_new_tokens) pairs, fixed by seed."""
    rng = random.Random(1234)
    return [(random_prompt(rng, n), m) for n, m in zip(PROMPT_LENGTHS, OUTPUT_LENGTHS)]


def expected_finish_reason(tokens: list[int], max_tokens: int) -> str:
    return "stop" if tokens and tokens[-1] == EOS_TOKEN_ID else "length"


# cpu: with the C++ kernels; cpu-pytorch: the same backend's PyTorch paths; sdpa: portable.
BACKENDS = {"cpu": dict(attention_backend="cpu"),
            "cpu-pytorch": dict(attention_backend="cpu", cpu_kernels=False),
            "sdpa": dict(attention_backend="sdpa")}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, setting, backend, separated_checkpoint, hf_greedy,
                                     carpool_device):
    if backend.startswith("cpu") and carpool_device != "cpu":
        pytest.skip("the cpu backend runs on CPU only")
    prompts = workload()
    references = [hf_greedy(arch, ids, n) for ids, n in prompts]
    llm = LLM(str(separated_checkpoint(arch)), dtype="float32", device=carpool_device,
              **BACKENDS[backend], **SETTINGS[setting])
    runner = llm.engine.runner
    assert runner.attention.name == BACKENDS[backend]["attention_backend"]
    if backend.startswith("cpu"):
        assert (runner.attention.kernels is not None) == (backend == "cpu")
    num_partial_chunks = 0

    def count_partial_chunks(sched_out):
        nonlocal num_partial_chunks
        num_partial_chunks += sum(not s.sample for s in sched_out.scheduled)

    llm.engine.step_hook = count_partial_chunks
    # Each prompt three times (full length, half, one token): 36 requests at once, longest
    # prompt first, so the long ones hold most of the KV pool while the short ones grow.
    requests = [(ids, ref, max_tokens) for (ids, n), ref in zip(prompts, references)
                for max_tokens in (n, max(1, n // 2), 1)][::-1]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids, _, _ in requests],
                           [SamplingParams(temperature=0.0, max_tokens=m) for _, _, m in requests],
                           use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for (ids, ref, max_tokens), out in zip(requests, outputs):
        expected = ref[:max_tokens]
        completion = out.outputs[0]
        assert out.prompt_token_ids == ids
        assert completion.token_ids == expected, (
            f"{arch}/{setting}: prompt of {len(ids)} tokens, max_tokens={max_tokens}")
        assert completion.finish_reason == expected_finish_reason(expected, max_tokens)
        assert completion.text == tokenizer.decode(expected, skip_special_tokens=True)

    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    llm.engine.check_integrity()
    if setting in ("chunked_prefill", "partial_prefills"):
        assert num_partial_chunks > 0
    if setting == "unchunked":
        assert num_partial_chunks == 0
    if setting.startswith("preemption"):
        assert stats.num_preemptions > 0
    else:
        assert stats.num_preemptions == 0
