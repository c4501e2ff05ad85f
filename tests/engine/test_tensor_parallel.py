"""Tensor parallelism over two gloo ranks on CPU gives Hugging Face's greedy tokens.

The same workload and references as `test_hf_equivalence` (which holds TP=1 to
them), run with `tensor_parallel_size=2`: rank 1 is a process carpool spawns,
every layer is split across the two, and the tokens must be identical in float32.
Models: GQA (llama), MQA with its one KV head replicated on both ranks (mistral),
tied embeddings (qwen2), head_dim != hidden/heads (qwen3), head_dim 40 with one KV
head under default, chunked prefill with preemption, and the static baseline; and a
vocabulary of 515 (padded to 516 for two ranks) under the default.
"""

from __future__ import annotations

import pytest

from carpool import LLM, SamplingParams
from tests.engine.test_hf_equivalence import expected_finish_reason, workload

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "llama-head-dim-40")
SETTINGS = {
    "default": dict(num_kv_blocks=256),
    # 32-token steps: long prompts prefill in chunks beside decodes; 96 blocks of 4
    # tokens are too few for every request at once, so some are preempted.
    "chunked_preemption": dict(num_kv_blocks=96, block_size=4, max_num_batched_tokens=32),
    "static": dict(num_kv_blocks=256, scheduler="static", max_num_seqs=8),
}


CASES = [(arch, setting) for arch in ARCHS for setting in SETTINGS] + [
    ("llama-odd-vocab", "default")]


@pytest.mark.parametrize("arch,setting", CASES)
def test_tensor_parallel_greedy_matches_transformers(arch, setting, separated_checkpoint,
                                                     hf_greedy):
    prompts = workload()
    references = [hf_greedy(arch, ids, n) for ids, n in prompts]
    requests = [(ids, ref, max_tokens) for (ids, n), ref in zip(prompts, references)
                for max_tokens in (n, 1)][::-1]
    with LLM(str(separated_checkpoint(arch)), dtype="float32", tensor_parallel_size=2,
             **SETTINGS[setting]) as llm:
        runner = llm.engine.runner
        assert runner.group.world_size == 2 and runner.group.backend == "gloo"
        outputs = llm.generate([{"prompt_token_ids": ids} for ids, _, _ in requests],
                               [SamplingParams(temperature=0.0, max_tokens=m)
                                for _, _, m in requests], use_tqdm=False)
        for (ids, ref, max_tokens), out in zip(requests, outputs):
            expected = ref[:max_tokens]
            assert out.outputs[0].token_ids == expected, (
                f"{arch}/{setting}: prompt of {len(ids)} tokens, max_tokens={max_tokens}")
            assert out.outputs[0].finish_reason == expected_finish_reason(expected, max_tokens)
        stats = llm.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert (stats.num_preemptions > 0) == (setting == "chunked_preemption")
        processes = list(runner._processes)
    assert [p.exitcode for p in processes] == [0]  # rank 1 shut down cleanly


def test_tensor_parallel_prompt_logprobs_equal_one_ranks(separated_checkpoint):
    """Prompt logprobs need every rank in the LM head's collective for the prompt rows,
    chunk by chunk (a 16-token budget cuts the prompt in pieces)."""
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    results = []
    for tp in (1, 2):
        with LLM(str(separated_checkpoint("llama")), dtype="float32", tensor_parallel_size=tp,
                 num_kv_blocks=64, max_num_batched_tokens=16) as llm:
            results.append(llm.generate([{"prompt_token_ids": prompt}], params,
                                        use_tqdm=False)[0])
    one, two = results
    assert two.outputs[0].token_ids == one.outputs[0].token_ids
    assert one.prompt_logprobs[0] is None and two.prompt_logprobs[0] is None
    assert len(two.prompt_logprobs) == len(prompt)
    for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for token_id in a:
            assert abs(a[token_id].logprob - b[token_id].logprob) < 1e-4


def test_tensor_parallel_speculative_decoding_keeps_greedy_outputs(separated_checkpoint):
    """Verify rows are a collective: rank 1 computes the same 1 + k logits rows as rank 0
    (the drafts cross in the step message), and the tokens equal one rank's without drafts."""
    from tests.engine.test_speculative_decoding import NGRAM, repetitive_prompts

    prompts = repetitive_prompts(7)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    path = str(separated_checkpoint("qwen3"))  # the one whose outputs loop: drafts accepted
    with LLM(path, dtype="float32", num_kv_blocks=256) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    with LLM(path, dtype="float32", num_kv_blocks=256, tensor_parallel_size=2,
             speculative_config=NGRAM) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        stats = llm.stats()
        assert stats.spec_decode_num_accepted_tokens > 0
        assert stats.num_free_blocks == stats.num_total_blocks
    assert got == expected


def test_tensor_parallel_speculation_under_a_grammar(separated_checkpoint):
    """Grammar requests speculating over two ranks (rank 0 masks the verify rows): greedy
    outputs equal one rank's without speculation and satisfy their grammars."""
    from tests.engine.test_speculative_decoding import NGRAM
    from tests.engine.test_speculative_grammar import GRAMMARS, PROMPTS, satisfies

    path = str(separated_checkpoint("qwen3"))

    def run(llm):
        return {kind: [(o.outputs[0].token_ids, o.outputs[0].text) for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=grammar),
            use_tqdm=False)] for kind, grammar in GRAMMARS.items()}
    with LLM(path, dtype="float32", num_kv_blocks=256) as one:
        expected = run(one)
    with LLM(path, dtype="float32", num_kv_blocks=256, tensor_parallel_size=2,
             speculative_config=NGRAM) as llm:
        got = run(llm)
        stats = llm.stats()
        assert stats.spec_decode_num_accepted_tokens > 0
        assert stats.num_free_blocks == stats.num_total_blocks
    assert got == expected
    assert all(satisfies(kind, text) for kind in got for _, text in got[kind])
