"""Speculative decoding (n-gram prompt lookup, a draft model) changes how many steps a request
takes, never what it gets: greedy outputs equal those without speculation and Hugging Face's
`generate` (four architectures; default, chunked prefill with preemption, prefix-cached
settings); in batch-invariant mode every emitted token's logprobs are bitwise those without
it (and n-gram's seeded samples too; a draft model's are reproducible); stops land where
they would.

Prompts repeat a random segment, and tiny random models fall into loops, so the n-gram
lookup proposes and the model accepts. The draft model here is the target itself, which
must then have every draft accepted (a smaller draft: test_draft_model.py). Every test
asserts accepted tokens, so none passes with speculation silently off.
"""

from __future__ import annotations

import random
import re

import pytest

from carpool import LLM, SamplingParams
from carpool import kernels as cpu_kernels
from carpool.testing.checkpoints import random_prompt

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
# prompt_lookup_min 1: a draft whenever the last token occurred before (random models
# repeat single tokens far more often than pairs)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 5,
         # every step of these small batches speculates (the default stops above 4 requests)
         "disable_by_batch_size": 64}
SETTINGS = {
    "default": dict(num_kv_blocks=256, enable_prefix_caching=False),
    # a 24-token budget chunks the long prompts beside speculating decodes (which then get
    # fewer drafts); 60 blocks of 4 tokens make the requests preempt each other
    "chunked_preemption": dict(num_kv_blocks=60, block_size=4, max_num_batched_tokens=24,
                               enable_prefix_caching=False),
    # each prompt sent twice: the second copies hit the first copies' blocks
    "prefix_cached": dict(num_kv_blocks=256, block_size=8),
}
EOS_TOKEN_ID = 0
METHODS = ("ngram", "draft_model")


def speculative(method: str, path: str) -> dict:
    """The test config of `method` for the target at `path` (it drafts for itself)."""
    if method == "ngram":
        return NGRAM
    # draft_pass_cost 0: a draft as costly as the target never pays, and the pause would
    # stop it; these tests want every step to draft
    return {"method": "draft_model", "model": path, "num_speculative_tokens": 3,
            "disable_by_batch_size": 64, "draft_pass_cost": 0}


def assert_drafts_accepted(stats, method: str) -> None:
    """Drafts were verified and accepted; a model drafting for itself: all of them."""
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    if method == "draft_model":
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


def repetitive_prompts(seed: int, count: int = 8) -> list[list[int]]:
    """Random segments of 3 to 12 tokens repeated 2 to 4 times, after a random lead-in."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        segment = random_prompt(rng, rng.randrange(3, 13))
        prompts.append(random_prompt(rng, rng.randrange(1, 9)) + segment * rng.randrange(2, 5))
    return prompts


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int, **extra) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra),
                           use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


def assert_clean(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    llm.engine.check_integrity()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_no_speculation_and_transformers(arch, setting, method,
                                                       separated_checkpoint, hf_greedy):
    path = str(separated_checkpoint(arch))
    prompts = repetitive_prompts(7)
    if setting == "prefix_cached":
        prompts = prompts + prompts
    max_tokens = 64
    with LLM(path, dtype="float32", device="cpu", **SETTINGS[setting]) as plain:
        expected = greedy(plain, prompts, max_tokens)
    with LLM(path, dtype="float32", device="cpu", speculative_config=speculative(method, path),
             **SETTINGS[setting]) as llm:
        got = greedy(llm, prompts, max_tokens)
        stats = llm.stats()
        assert_clean(llm)
    assert got == expected
    for prompt, tokens in zip(prompts[:3], got):
        assert tokens == hf_greedy(arch, prompt, max_tokens)[:len(tokens)]
        assert len(tokens) == max_tokens or tokens[-1] == EOS_TOKEN_ID
    assert_drafts_accepted(stats, method)
    assert 0 < stats.spec_decode_num_drafts
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == \
        stats.spec_decode_num_accepted_tokens
    if setting == "chunked_preemption":
        assert stats.num_preemptions > 0
    if setting == "prefix_cached":
        assert stats.prefix_cache_hits > 0


@pytest.mark.parametrize("method", METHODS)
def test_stops_land_where_they_would_without_speculation(method, separated_checkpoint):
    """max_tokens, min_tokens with EOS, stop token ids and stop strings cut a step's accepted
    drafts exactly where single-token steps stop."""
    path = str(separated_checkpoint("qwen3"))  # the one that loops most
    prompts = repetitive_prompts(11, count=8)
    with LLM(path, dtype="float32", device="cpu", num_kv_blocks=256) as plain:
        free_run = greedy(plain, prompts, 30, ignore_eos=True)
        # stop on a token each output reaches part-way, and on its text
        stop_ids = [tokens[len(tokens) // 2] for tokens in free_run]
        tokenizer = plain.get_tokenizer()
        stop_texts = [tokenizer.decode(tokens[9:11]) for tokens in free_run]
        cases = [dict(max_tokens=7, ignore_eos=True), dict(max_tokens=30, min_tokens=12),
                 *[dict(max_tokens=30, stop_token_ids=[t], ignore_eos=True) for t in stop_ids],
                 *[dict(max_tokens=30, stop=[s], ignore_eos=True) for s in stop_texts if s]]

        def run(llm):
            results = []
            for extra in cases:
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                    SamplingParams(temperature=0.0, **extra), use_tqdm=False)
                results.append([(o.outputs[0].token_ids, o.outputs[0].text,
                                 o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                                for o in outs])
            return results
        expected = run(plain)
    with LLM(path, dtype="float32", device="cpu", num_kv_blocks=256,
             speculative_config=speculative(method, path)) as llm:
        assert run(llm) == expected
        assert_drafts_accepted(llm.stats(), method)
        assert_clean(llm)


@pytest.mark.parametrize("method", METHODS)
def test_penalties_and_logprobs_per_verified_position(method, separated_checkpoint):
    """A repetition penalty sees each draft position's own history; logprobs come one per
    emitted token and equal the plain run's (float32 tiny model: to rounding)."""
    path = str(separated_checkpoint("qwen2"))
    prompts = repetitive_prompts(5)
    params = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.05,
                            logprobs=3)

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    with LLM(path, dtype="float32", device="cpu", num_kv_blocks=256) as plain:
        expected = run(plain)
    with LLM(path, dtype="float32", device="cpu", num_kv_blocks=256,
             speculative_config=speculative(method, path)) as llm:
        got = run(llm)
        assert_drafts_accepted(llm.stats(), method)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected):
        assert tokens == want_tokens
        assert len(logprobs) == len(tokens)
        for position, want in zip(logprobs, want_logprobs):
            assert position.keys() == want.keys()
            for token_id, logprob in position.items():
                assert logprob.rank == want[token_id].rank
                assert logprob.logprob == pytest.approx(want[token_id].logprob, abs=1e-4)


@pytest.fixture(scope="module")
def kernels():
    if cpu_kernels.load() is None:
        pytest.skip("batch-invariant mode needs the compiled C++ kernels")


@pytest.mark.parametrize("method", METHODS)
def test_batch_invariant_logprobs_and_seeded_samples_bitwise(method, separated_checkpoint,
                                                             kernels):
    """Greedy: logprobs bitwise those without speculation. Seeded samples: with n-gram
    drafts bitwise those without (the rows draw a plain decode's numbers); with a draft
    model, rejection sampling draws its own, so the same seeds give the same tokens again."""
    path = str(separated_checkpoint("qwen3"))  # the one that loops most: drafts get accepted
    prompts = repetitive_prompts(3, count=6)
    params = [SamplingParams(temperature=0.0, max_tokens=32, logprobs=5, ignore_eos=True),
              SamplingParams(temperature=0.5, top_p=0.95, max_tokens=32, logprobs=5, seed=11,
                             ignore_eos=True)]

    def run(llm, param):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], param, use_tqdm=False)
        return [(o.outputs[0].token_ids,
                 [sorted((t, lp.logprob, lp.rank) for t, lp in pos.items())
                  for pos in o.outputs[0].logprobs]) for o in outs]
    settings = dict(dtype="float32", device="cpu", num_kv_blocks=256, batch_invariant=True)
    with LLM(path, **settings) as plain:
        expected = [run(plain, param) for param in params]
    with LLM(path, speculative_config=speculative(method, path), **settings) as llm:
        for param, want in zip(params, expected):
            accepted = llm.stats().spec_decode_num_accepted_tokens
            got = run(llm, param)
            if method == "ngram" or param.temperature == 0.0:
                assert got == want
            else:  # the target's logprobs of the tokens it emitted, whatever they are
                assert [len(tokens) for tokens, _ in got] == [32] * len(prompts)
            assert llm.stats().spec_decode_num_accepted_tokens > accepted
            assert run(llm, param) == got  # the same seeds give the same tokens again
        assert_clean(llm)


@pytest.mark.parametrize("method", METHODS)
def test_sampled_grammar_requests_speculate_and_keep_their_grammar(method):
    """Structured outputs speculate too, every verified position sampled under its own mask:
    seeded samples hold the grammar; with n-gram drafts they equal those without speculation
    (the rows draw a plain decode's numbers), with a draft model (rejection sampling draws
    its own) the same seeds give the same tokens again. A plain request beside them keeps
    its output."""
    from carpool import StructuredOutputsParams

    regex = r"[0-9]{3}-[a-z]{2}"
    looping = "def add(a, b):\n    return a + b\n\n" * 2 + "def add("
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(regex=regex))
              for i in range(3)] + [SamplingParams(temperature=0.0, max_tokens=48,
                                                   ignore_eos=True)]
    prompts = ["A code:"] * 3 + [looping]

    def run(llm):
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(max_model_len=256, num_kv_blocks=64) as plain:
        expected = [(o.text, o.token_ids) for o in run(plain)]
    with LLM(max_model_len=256, num_kv_blocks=64,
             speculative_config=speculative(method, "carpool-default")) as llm:
        outs = run(llm)
        again = [(o.text, o.token_ids) for o in run(llm)]
        assert llm.stats().spec_decode_num_accepted_tokens > 0
        assert_clean(llm)
    for out in outs[:3]:
        assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), out.text
    got = [(o.text, o.token_ids) for o in outs]
    assert again == got and got[3] == expected[3]
    if method == "ngram":
        assert got == expected
