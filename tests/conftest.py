"""Shared fixtures: tiny random checkpoints of each architecture, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def pytest_addoption(parser):
    parser.addoption("--carpool-device", default="cpu",
                     help="device the HF-equivalence suite runs carpool on (cpu, cuda)")


@pytest.fixture(scope="session")
def carpool_device(request) -> str:
    return request.config.getoption("--carpool-device")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    from carpool.testing.checkpoints import train_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory, tokenizer_dir):
    """Factory: make_checkpoint(arch, **overrides) -> folder, cached per argument set."""
    from carpool.testing.checkpoints import build_checkpoint

    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", **overrides) -> Path:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"ckpt_{arch}")
            cache[key] = build_checkpoint(path, arch, tokenizer_dir=tokenizer_dir, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_checkpoint(make_checkpoint) -> Path:
    return make_checkpoint("llama")
