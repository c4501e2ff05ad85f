"""A real `carpool serve` in a subprocess on a free loopback port, shared by the server tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from carpool.bench.local_server import LocalServer
from tests.server.live import MODEL_NAME, SERVER_FLAGS, Server


@pytest.fixture(scope="session")
def server(llama_checkpoint, tmp_path_factory):
    local = LocalServer(llama_checkpoint, SERVER_FLAGS,
                        tmp_path_factory.mktemp("server") / "server.log")
    with local as base_url:
        yield Server(local, base_url, MODEL_NAME, Path(llama_checkpoint))


@pytest.fixture(scope="session")
def client(server):
    return server.client()
