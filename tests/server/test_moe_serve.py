"""A mixture of experts served by `carpool serve` (a live server, the official openai client)
returns what the offline `LLM` does for the same greedy requests, completions and chat, and
with --moe-router-stats `GET /stats` carries the router's rows per expert."""

from __future__ import annotations

from pathlib import Path

import pytest

from carpool.bench.local_server import LocalServer
from tests.server.live import SERVER_FLAGS, Server, assert_greedy_equals_offline

pytestmark = pytest.mark.slow  # a live server (still run in CI)

PROMPTS = ["def fibonacci(n):", "import sys\nimport os\n", "class Point:\n    def __init__(self"]


@pytest.fixture(scope="module")
def moe_server(make_checkpoint, tmp_path_factory):
    checkpoint = make_checkpoint("qwen3_moe")
    local = LocalServer(checkpoint, [*SERVER_FLAGS, "--moe-router-stats"],
                        tmp_path_factory.mktemp("moe-server") / "server.log")
    with local as base_url:
        yield Server(local, base_url, SERVER_FLAGS[SERVER_FLAGS.index("--served-model-name") + 1],
                     Path(checkpoint))


def test_moe_server_equals_offline_and_reports_router_load(moe_server):
    assert_greedy_equals_offline(moe_server, PROMPTS, 24)
    with moe_server.http() as http:
        stats = http.get("/stats").json()
    load = stats["router_load"]
    assert len(load) == 2 and all(len(layer) == 8 for layer in load)
    assert sum(load[0]) == sum(load[1]) > 0 and sum(load[0]) % 2 == 0  # top 2 per row
