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
from tests.server.live import (SERVER_FLAGS, Server, assert_greedy_equals_offline, metric_value,
                               wait_until_idle)

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
