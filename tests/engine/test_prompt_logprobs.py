"""Prompt logprobs equal Hugging Face transformers' log-softmax of the same checkpoint
(float32, within 1e-3), whole or chunked, and never come from a prefix-cache hit."""

from __future__ import annotations

import pytest
import torch

from carpool import LLM, SamplingParams

PROMPT = [3, 17, 99, 5, 42, 8, 250, 31, 77, 12, 64, 9, 140, 2, 55, 300, 21, 6, 88, 45,
          19, 73, 11, 130, 4, 66, 201, 38, 92, 15, 27, 180, 7, 58, 36, 111]  # 36 tokens
TOP = 3


@pytest.fixture(scope="module")
def hf_logprobs(llama_checkpoint):
    """transformers' float32 log-softmax over PROMPT: row p scores token p + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_checkpoint),
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_against_hf(positions, hf: torch.Tensor) -> None:
    assert len(positions) == len(PROMPT) and positions[0] is None
    for p, (token_id, entry) in enumerate(zip(PROMPT[1:], positions[1:])):
        expected = hf[p]
        assert entry[token_id].logprob == pytest.approx(expected[token_id].item(), abs=1e-3)
        assert entry[token_id].rank == int((expected > expected[token_id]).sum()) + 1
        top_ids = expected.topk(TOP).indices.tolist()
        assert set(entry) == set(top_ids) | {token_id}
        for t in top_ids:
            assert entry[t].logprob == pytest.approx(expected[t].item(), abs=1e-3)


@pytest.mark.parametrize("budget", [2048, 16], ids=["whole", "chunked-16"])
def test_prompt_logprobs_match_transformers(llama_checkpoint, hf_logprobs, budget):
    llm = LLM(str(llama_checkpoint), dtype="float32", device="cpu", num_kv_blocks=64,
              max_model_len=128, max_num_batched_tokens=budget,
              long_prefill_token_threshold=budget if budget < 128 else 0)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    check_against_hf(out.prompt_logprobs, hf_logprobs)
    # asked again with the prompt's blocks in the prefix cache: still computed, still equal
    again = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    check_against_hf(again.prompt_logprobs, hf_logprobs)
    plain = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2),
                         use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0


def test_prompt_logprobs_over_max_logprobs_are_refused(llama_checkpoint):
    llm = LLM(str(llama_checkpoint), device="cpu", num_kv_blocks=16, max_model_len=64,
              max_logprobs=2)
    with pytest.raises(ValueError, match="prompt_logprobs must be <= 2"):
        llm.generate("hi there", SamplingParams(prompt_logprobs=3), use_tqdm=False)
    one = llm.generate({"prompt_token_ids": [5]}, SamplingParams(max_tokens=1,
                                                                 prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]


def test_chunks_recomputed_after_a_preemption_are_joined_once():
    """Held: positions 1..20. A preemption recomputes the prompt in other chunks: the ones
    before 21 add nothing, the one straddling it adds only 21.., the rest follow on."""
    from carpool.engine.request_state import RequestState
    from carpool.outputs import PromptLogprobs

    def chunk(start: int, end: int) -> PromptLogprobs:
        n = end - start
        return PromptLogprobs(start, tuple(range(start, end)), tuple(-float(i) for i in
                              range(start, end)), (1,) * n, ((0,),) * n, ((-0.5,),) * n)

    state = RequestState(request=None, detokenizer=None)
    for start, end in ((1, 9), (9, 21), (1, 13), (13, 25), (25, 30), (5, 12)):
        state.add_prompt_logprobs(chunk(start, end))
    held = state.prompt_logprobs
    assert (held.start, held.end) == (1, 30)
    assert held.token_ids == tuple(range(1, 30))
    assert held.logprobs == tuple(-float(i) for i in range(1, 30))
    positions = held.positions()
    assert positions[0] is None and positions[29][29].logprob == -29.0
    assert positions[29][0].rank == 1
