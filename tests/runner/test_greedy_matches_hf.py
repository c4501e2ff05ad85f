"""Greedy decoding through ModelRunner equals transformers' `generate(do_sample=False)`.

Three requests arrive on different steps, prefill in chunks alongside each
other's decodes (mixed batches), over shuffled KV blocks. HF stops at EOS, the
runner does not (stopping is the engine's job), so the runner's tokens are
compared up to HF's length.
"""

from __future__ import annotations

import pytest
import torch

from runner_driver import Driver, DriverRequest, hf_greedy
from carpool.sampling_params import SamplingParams

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
MAX_TOKENS = 12
# Fresh random models have flat logits; a wider init keeps greedy argmax gaps far above float error.
SHARP = dict(initializer_range=0.2)


def _requests(prompts, max_tokens=MAX_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [DriverRequest(f"r{i}", p, params, arrival_step=step)
            for i, (p, step) in enumerate(zip(prompts, (0, 1, 3)))]


def _check(outputs, references):
    for request_id, ref in references.items():
        assert outputs[request_id][:len(ref)] == ref, request_id


@pytest.fixture(scope="module")
def references(make_checkpoint):
    cache = {}

    def get(arch, prompts):
        if arch not in cache:
            path = make_checkpoint(arch, **SHARP)
            cache[arch] = {f"r{i}": hf_greedy(path, p, MAX_TOKENS) for i, p in enumerate(prompts)}
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_chunked_batch_matches_hf(arch, make_checkpoint, make_runner, prompts, references):
    runner = make_runner(make_checkpoint(arch, **SHARP))
    outputs = Driver(runner, chunk=16).run(_requests(prompts))
    _check(outputs, references(arch, prompts))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_preempted_request_recomputes_identically(arch, make_checkpoint, make_runner, prompts,
                                                  references):
    runner = make_runner(make_checkpoint(arch, **SHARP))
    driver = Driver(runner, chunk=8, seed=1)
    # r0 is preempted mid-decode and r2 mid-prefill; both come back with num_computed=0.
    outputs = driver.run(_requests(prompts), preempt_at={9: "r0", 5: "r2"})
    _check(outputs, references(arch, prompts))


def test_padding_tokens_change_nothing(make_checkpoint, make_runner, prompts, references):
    path = make_checkpoint("llama", **SHARP)
    plain, padded = make_runner(path), make_runner(path)
    out_plain = Driver(plain, chunk=16).run(_requests(prompts))
    out_padded = Driver(padded, chunk=16, padding=5).run(_requests(prompts))
    assert out_padded == out_plain
    _check(out_padded, references("llama", prompts))
    real = slice(0, plain.num_kv_blocks)  # the scratch block sits past the pool
    for cache_plain, cache_padded in zip(plain.kv_caches, padded.kv_caches):
        # Equal up to float rounding from the different matmul shapes; a padding token
        # written into a real slot would differ by O(1).
        torch.testing.assert_close(cache_padded[:, real], cache_plain[:, real], atol=1e-5, rtol=0)


def test_request_alone_equals_in_batch(make_checkpoint, make_runner, prompts):
    path = make_checkpoint("qwen2", **SHARP)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    alone = Driver(make_runner(path), chunk=64).run([DriverRequest("x", prompts[2], params)])
    batch = _requests(prompts) + [DriverRequest("x", prompts[2], params, arrival_step=2)]
    together = Driver(make_runner(path), chunk=16).run(batch)
    assert together["x"] == alone["x"]


def test_one_token_and_long_prompts_match_hf(make_checkpoint, make_runner):
    path = make_checkpoint("mistral", **SHARP)
    gen = torch.Generator().manual_seed(11)
    prompts = [[17], torch.randint(1, 512, (320,), generator=gen).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    requests = [DriverRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
    outputs = Driver(make_runner(path, num_kv_blocks=200), chunk=64).run(requests)
    _check(outputs, {f"r{i}": hf_greedy(path, p, MAX_TOKENS) for i, p in enumerate(prompts)})
