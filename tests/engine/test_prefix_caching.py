"""Prefix caching end to end: greedy outputs equal transformers' and caching off, hits happen.

Prompts share two system prefixes (70 and 33 tokens) with short user suffixes
(the first pass shares them within the step that computes them),
and one is exactly a whole number of blocks (its last token must still be
computed). Each workload runs twice through one `LLM`: the second pass must be
served mostly from the cache. The tight setting chunks prompts, preempts and
evicts cached blocks while it runs.
"""

from __future__ import annotations

import random

import pytest

from carpool import LLM, SamplingParams
from carpool.testing.checkpoints import random_prompt

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
MAX_TOKENS = 10

SETTINGS = {
    "default": dict(num_kv_blocks=256),
    # Blocks of 4, 24-token steps, two partial prefills: a pool of 40 blocks cannot hold
    # every request's prefix and outputs at once, so requests are preempted and cached
    # free blocks are evicted.
    "chunked_preemption_eviction": dict(num_kv_blocks=40, block_size=4,
                                        max_num_batched_tokens=24, max_num_partial_prefills=2,
                                        long_prefill_token_threshold=16),
}


def workload() -> list[list[int]]:
    rng = random.Random(99)
    system_a, system_b = random_prompt(rng, 70), random_prompt(rng, 33)
    prompts = [system + random_prompt(rng, n) for system in (system_a, system_b)
               for n in (1, 6, 21)]
    return prompts + [system_a[:64]]  # exactly 4 blocks of 16 (16 blocks of 4)


def run(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_cached_prefixes_give_transformers_greedy_outputs(arch, setting, separated_checkpoint,
                                                          hf_greedy):
    prompts = workload()
    references = [hf_greedy(arch, p, MAX_TOKENS) for p in prompts]
    llm = LLM(str(separated_checkpoint(arch)), dtype="float32", device="cpu",
              **SETTINGS[setting])
    first_chunks, steps = {}, []
    llm.engine.step_hook = lambda out: steps.append(out) or first_chunks.update(
        {s.request_id: s.num_computed_tokens for s in out.scheduled
         if s.request_id not in first_chunks})
    cache = llm.engine.scheduler.block_manager.prefix_cache
    evictions = []
    evict = cache.evict
    cache.evict = lambda: evictions.append(1) or evict()
    first = run(llm, prompts)
    hits_after_first = llm.stats().prefix_cache_hits
    second = run(llm, prompts)
    stats = llm.stats()
    for passes in (first, second):
        for prompt, reference, out in zip(prompts, references, passes):
            expected = reference[:MAX_TOKENS]
            assert out.outputs[0].token_ids == expected, f"{arch}/{setting}: {len(prompt)} tokens"
    assert stats.prefix_cache_queries == 2 * sum(len(p) for p in prompts)
    assert stats.prefix_cache_hits > hits_after_first
    assert all(out.num_cached_tokens < len(p) for p, out in zip(prompts, second))
    if setting == "default":
        # Second pass: every prompt but the shortest finds all its full blocks but the last token's.
        block = 16
        for prompt, out in zip(prompts, second):
            assert out.num_cached_tokens == (len(prompt) - 1) // block * block
        # A request whose first step starts past position 0 attends to its prefix in the cache:
        # already in the very first step, which computes that prefix for another request.
        assert any(n > 0 for n in first_chunks.values())
        assert any(s.num_computed_tokens > 0 for s in steps[0].scheduled)
    else:
        assert stats.num_preemptions > 0 and evictions
    assert stats.num_free_blocks == stats.num_total_blocks
    llm.engine.check_integrity()

    if setting == "default":
        off = LLM(str(separated_checkpoint(arch)), dtype="float32", device="cpu",
                  enable_prefix_caching=False, **SETTINGS[setting])
        outputs_off = run(off, prompts)
        assert [o.outputs[0].token_ids for o in outputs_off] == \
            [o.outputs[0].token_ids for o in second]
        assert off.stats().prefix_cache_hits == 0


def test_tenants_with_different_salts_never_share_blocks(separated_checkpoint):
    llm = LLM(str(separated_checkpoint("llama")), dtype="float32", device="cpu",
              num_kv_blocks=128, block_size=4)
    engine = llm.engine
    tables: dict[str, set[int]] = {}
    engine.step_hook = lambda out: [tables.setdefault(s.request_id, set()).update(s.block_ids)
                                    for s in out.scheduled]
    prompt = random_prompt(random.Random(5), 40)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for request_id, salt in (("a1", "tenant-a"), ("b1", "tenant-b"), ("a2", "tenant-a"),
                             ("none", None)):
        engine.add_request(request_id, prompt, params, cache_salt=salt)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert outputs[-1].num_cached_tokens == (36 if request_id == "a2" else 0)
    assert tables["a1"] & tables["a2"]  # same tenant: shared
    for other in ("b1", "none"):
        assert not tables[other] & (tables["a1"] | tables["a2"])
    assert not tables["b1"] & tables["none"]
    engine.check_integrity()


def test_a_cached_prefix_is_read_from_the_cache_not_the_fresh_prompt_path():
    """The attention backends take their fresh-prompt fast path (attend to this step's keys
    only) just for chunks starting at position 0; a chunk after a cached prefix reads the
    cache."""
    import torch

    from carpool.attention import paged
    from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput
    from carpool.runner.input_batch import build_input_batch

    def split(num_computed):
        request = ScheduledRequest("r", token_ids=[1, 2, 3, 4, 5], num_computed_tokens=num_computed,
                                   block_ids=[0, 1, 2], sample=True,
                                   sampling_params=SamplingParams())
        layout = build_input_batch(SchedulerOutput([request]), block_size=4, scratch_block=3,
                                   device=torch.device("cpu")).layout
        return paged.split_step(layout, fresh_fast_path=True)

    fresh = split(0)
    assert fresh.fresh.tolist() == [0] and fresh.chunks.size == 0
    cached = split(4)
    assert cached.fresh.size == 0 and cached.chunks.tolist() == [0]
