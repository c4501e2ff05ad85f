"""A live `carpool serve` of the built-in model for the structured-output and tool tests."""

from __future__ import annotations

import pytest

from carpool.bench.local_server import LocalServer
from carpool.default_model_path import default_model_path

MODEL = "carpool-default"
FLAGS = ["--max-model-len", "512", "--num-kv-blocks", "256", "--max-num-seqs", "16",
         "--served-model-name", MODEL, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
         "--dtype", "float32",  # the seeded samples the tests expect are float32's
         # lets 2,010 choices reach the parser, whose row limit fails them mid-generation
         "--max-grammar-alternatives", "10000"]


@pytest.fixture(scope="session")
def base_url(tmp_path_factory):
    log = tmp_path_factory.mktemp("structured-server") / "server.log"
    with LocalServer(default_model_path(), FLAGS, log) as url:
        yield url


@pytest.fixture(scope="session")
def client(base_url):
    import openai
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
