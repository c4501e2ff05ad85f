"""`carpool serve --speculative-config` with a draft model (a live server, the official openai
client): greedy completions, streamed or whole, and chat equal the offline `LLM` without
speculation; sampled requests finish with their token counts; /metrics counts the drafts
and their accepted tokens; /stats shows the KV pool whole once idle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from carpool.bench.local_server import LocalServer
from carpool.testing.checkpoints import truncated_checkpoint
from tests.server.live import (MESSAGES, SERVER_FLAGS, Server, assert_greedy_equals_offline,
                               metric_value, wait_until_idle)

pytestmark = pytest.mark.slow  # a live server (still run in CI)

PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(",
           "import sys\nimport os\nimport sys\nimport os\n", "class Point:\n    def __init__(self"]


@pytest.fixture(scope="module")
def draft_server(llama_checkpoint, tmp_path_factory):
    draft = truncated_checkpoint(llama_checkpoint, tmp_path_factory.mktemp("draft"), 1)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    local = LocalServer(llama_checkpoint, [*SERVER_FLAGS, "--speculative-config",
                                           json.dumps(spec)],
                        tmp_path_factory.mktemp("draft-server") / "server.log")
    with local as base_url:
        yield Server(local, base_url, SERVER_FLAGS[SERVER_FLAGS.index("--served-model-name") + 1],
                     Path(llama_checkpoint))


def test_a_draft_model_server_equals_offline_without_speculation(draft_server):
    expected = assert_greedy_equals_offline(draft_server, PROMPTS, 32)
    client = draft_server.client()
    stream = client.completions.create(model=draft_server.model, prompt=PROMPTS[1],
                                       max_tokens=32, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == expected[1].outputs[0].text
    sampled = client.completions.create(model=draft_server.model, prompt=PROMPTS[0],
                                        max_tokens=24, temperature=0.8, seed=3, n=2,
                                        extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in sampled.choices] == ["length", "length"]
    assert sampled.usage.completion_tokens == 48
    snapshot = wait_until_idle(draft_server)
    assert snapshot["num_free_blocks"] == snapshot["num_total_blocks"]
    with draft_server.http() as http:
        metrics = http.get("/metrics").text
    drafted = metric_value(metrics, "carpool:spec_decode_num_draft_tokens_total")
    accepted = metric_value(metrics, "carpool:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafted


def test_structured_outputs_speculate_on_the_server(draft_server):
    """OpenAI's `response_format` JSON schema and vLLM's choice, greedy through the official
    client: each reply satisfies its grammar and equals the offline `LLM` without
    speculation, and the grammar requests' drafts are accepted (a constant the schema
    forces is drafted under the grammar's masks, token by token what the target samples)."""
    from carpool import LLM, SamplingParams, StructuredOutputsParams

    quote = "the quick brown fox jumps over the lazy dog"
    schema = {"type": "object", "additionalProperties": False, "required": ["quote", "n"],
              "properties": {"quote": {"enum": [quote]},
                             "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    choices = [f"{quote} and runs", "no"]
    with LLM(str(draft_server.checkpoint), dtype="float32", num_kv_blocks=128,
             max_model_len=256) as llm:
        want_chat = llm.chat(MESSAGES, SamplingParams(
            max_tokens=48, temperature=0,
            structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)
        want_choice = llm.generate(PROMPTS[0], SamplingParams(
            max_tokens=96, temperature=0,
            structured_outputs=StructuredOutputsParams(choice=choices)), use_tqdm=False)
    client = draft_server.client()
    with draft_server.http() as http:
        before = metric_value(http.get("/metrics").text,
                              "carpool:spec_decode_num_accepted_tokens_total")
    reply = client.chat.completions.create(
        model=draft_server.model, messages=MESSAGES, max_tokens=48, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "quote", "schema": schema, "strict": True}})
    content = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert json.loads(content)["quote"] == quote and content == want_chat[0].outputs[0].text
    choice = client.completions.create(model=draft_server.model, prompt=PROMPTS[0],
                                       max_tokens=96, temperature=0,
                                       extra_body={"structured_outputs": {"choice": choices}})
    assert choice.choices[0].finish_reason == "stop" and choice.choices[0].text in choices
    assert choice.choices[0].text == want_choice[0].outputs[0].text
    wait_until_idle(draft_server)
    with draft_server.http() as http:
        after = metric_value(http.get("/metrics").text,
                             "carpool:spec_decode_num_accepted_tokens_total")
    assert after > before
