"""carpool's greedy tokens under a LoRA adapter equal PEFT's model with that adapter applied.

For each architecture, three adapters written by `peft` itself with random non-zero A and
B (`init_lora_weights=False`): every module at rank 8, q/v at rank 4 with rsLoRA, the MLP and
o_proj at rank 16. One batch mixes base requests and all three adapters (more adapters than
`max_loras`, more than `max_cpu_loras`: some wait, some are evicted and read again), under
the default settings, chunked prefill with preemption, and prefix caching with every prompt
sent on two adapters and the base model; every request's tokens equal PEFT's for it alone.
"""

from __future__ import annotations

import random

import pytest

from carpool import LLM, LoRARequest, SamplingParams
from carpool.testing.checkpoints import random_prompt
from carpool.testing.peft_adapters import ALL_MODULES, PeftGreedy, build_adapter

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
ADAPTERS = (dict(rank=8, alpha=16, target_modules=ALL_MODULES),
            dict(rank=4, alpha=8, target_modules=("q_proj", "v_proj"), use_rslora=True),
            dict(rank=16, alpha=8, target_modules=("o_proj", "gate_proj", "up_proj",
                                                   "down_proj")))
SETTINGS = {
    "default": dict(num_kv_blocks=256),
    # a 16-token budget (chunks beside decodes) and 24 blocks of 4 (the longest request
    # needs 18): requests preempt
    "chunked_preemption": dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=16),
    "prefix_cached": dict(num_kv_blocks=256, block_size=4),
}
PROMPT_LENGTHS = (1, 5, 17, 33, 64, 9, 40, 23)
OUTPUT_LENGTHS = (12, 20, 8, 16, 6, 24, 10, 14)


@pytest.fixture(scope="module")
def adapters(separated_checkpoint, tmp_path_factory):
    """arch -> (base folder, [adapter folders], PeftGreedy)."""
    made = {}

    def make(arch):
        if arch not in made:
            base = separated_checkpoint(arch)
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            folders = [build_adapter(base, root / f"adapter{i}", seed=10 + i, **spec)
                       for i, spec in enumerate(ADAPTERS)]
            made[arch] = base, folders, PeftGreedy(base)
        return made[arch]
    return make


def workload(setting: str):
    """(prompt ids, max_tokens, adapter index or None) triples."""
    rng = random.Random(7)
    prompts = [random_prompt(rng, n) for n in PROMPT_LENGTHS]
    if setting == "prefix_cached":  # each prompt on the base model and two adapters
        return [(p, m, which) for i, (p, m) in enumerate(zip(prompts[:4], OUTPUT_LENGTHS))
                for which in (None, i % 3, (i + 1) % 3)]
    return [(p, m, (None, 0, 1, 2)[i % 4]) for i, (p, m) in
            enumerate(zip(prompts, OUTPUT_LENGTHS))]


def lora_requests(folders):
    return [LoRARequest(f"adapter{i}", i + 1, str(folder)) for i, folder in enumerate(folders)]


@pytest.mark.parametrize("setting, kernels", [(setting, True) for setting in SETTINGS]
                         + [("default", False)])  # the adapters' term by torch's matmuls
@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_tokens_match_peft(arch, setting, kernels, adapters):
    base, folders, peft_greedy = adapters(arch)
    loras = lora_requests(folders)
    work = workload(setting)
    expected = [peft_greedy(None if which is None else folders[which], ids, n)
                for ids, n, which in work]
    assert len({tuple(e) for e in expected}) > len(work) // 2  # the adapters change tokens
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2,
              cpu_kernels=kernels, **SETTINGS[setting])
    assert (llm.engine.runner.lora_kernel is not None) == kernels
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids, _, _ in work],
        [SamplingParams(temperature=0.0, max_tokens=n) for _, n, _ in work],
        use_tqdm=False, lora_request=[None if w is None else loras[w] for _, _, w in work])
    for (ids, _, which), out, want in zip(work, outputs, expected):
        assert out.outputs[0].token_ids == want, (which, len(ids))
    stats = llm.engine.stats()
    assert stats.lora_evictions > 0 and stats.lora_loads >= 3  # three adapters, two places
    if setting == "chunked_preemption":
        assert stats.num_preemptions > 0
    if setting == "prefix_cached":
        assert stats.prefix_cache_hits == 0  # a prompt never repeats on the same adapter
    llm.engine.check_integrity()


def test_same_adapter_shares_prefix_blocks_and_alone_equals_mixed(adapters):
    base, folders, _ = adapters("llama")
    loras = lora_requests(folders)
    rng = random.Random(3)
    prompt = random_prompt(rng, 48)
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=4, num_kv_blocks=128,
              block_size=4)
    alone = [llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False,
                          lora_request=lora)[0].outputs[0].token_ids
             for lora in (None, *loras)]
    hits = llm.engine.stats().prefix_cache_hits
    assert hits == 0  # four different adapters: no block shared
    mixed = llm.generate([{"prompt_token_ids": prompt}] * 4, greedy, use_tqdm=False,
                         lora_request=[None, *loras])
    assert [o.outputs[0].token_ids for o in mixed] == alone
    assert llm.engine.stats().prefix_cache_hits == 4 * 44  # each hits its own adapter's blocks
    llm.engine.check_integrity()
