"""Fixtures of the reliability tests; the helpers they use are in live.py."""

from __future__ import annotations

import pytest

from tests.reliability.live import EDGE_FLAGS, live_server


@pytest.fixture(scope="session")
def reference_llm(llama_checkpoint):
    """The offline LLM on the same checkpoint: what greedy outputs must equal."""
    from carpool import LLM
    return LLM(str(llama_checkpoint), dtype="float32", max_model_len=512, num_kv_blocks=512)


@pytest.fixture(scope="session")
def edge_server(llama_checkpoint, tmp_path_factory):
    with live_server(llama_checkpoint, EDGE_FLAGS,
                     tmp_path_factory.mktemp("edge") / "server.log") as live:
        yield live
