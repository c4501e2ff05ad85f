"""Output over HTTP is exactly what the offline `LLM` produces for the same request."""

from __future__ import annotations

import pytest

from carpool import SamplingParams
from tests.server.live import MESSAGES

pytestmark = pytest.mark.slow  # a live server (still run in CI)

PROMPTS = ["def fibonacci(n):", "import sys\nimport os\n", "class Point:\n    def __init__(self"]


@pytest.fixture(scope="module")
def llm(server):
    from carpool import LLM
    return LLM(str(server.checkpoint), dtype="float32", num_kv_blocks=128,
               max_model_len=256)  # the server runs float32 too


def test_greedy_completions_equal_llm_generate(llm, client, server):
    expected = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0),
                            use_tqdm=False)
    out = client.completions.create(model=server.model, prompt=PROMPTS, max_tokens=24,
                                    temperature=0)
    for want, got in zip(expected, out.choices):
        assert got.text == want.outputs[0].text
        assert got.finish_reason == want.outputs[0].finish_reason
    assert out.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in expected)


def test_greedy_chat_equals_llm_chat(llm, client, server):
    (want,) = llm.chat(MESSAGES, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    got = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=16,
                                         temperature=0)
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)


def test_seeded_n2_equals_llm_generate(llm, client, server):
    params = SamplingParams(n=2, max_tokens=12, temperature=0.9, top_k=50, seed=99)
    (want,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    got = client.completions.create(model=server.model, prompt=PROMPTS[0], n=2, max_tokens=12,
                                    temperature=0.9, seed=99, extra_body={"top_k": 50})
    assert [c.text for c in got.choices] == [o.text for o in want.outputs]
