"""The `carpool` commands README.md and docs/serving.md show are true: each parses as written,
and each `carpool serve` example on the built-in model resolves to a config the server would
accept (what `carpool serve` checks before it binds a port)."""

from __future__ import annotations

from pathlib import Path

import pytest

from carpool.config import EngineConfig
from carpool.server.cli import server_settings_from_args
from tests.flags import command_parser, doc_commands, serve_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = {name: (ROOT / name).read_text() for name in ("README.md", "docs/serving.md")}
# what each page must show at least (so a broken extraction cannot pass on nothing)
EXPECTED = {"README.md": {"serve", "bench"},
            "docs/serving.md": {"serve", "bench", "simulate", "tp-worker"}}


def commands() -> list[tuple[str, str, list[str]]]:
    return [(page, name, argv) for page, text in PAGES.items()
            for name, argv in doc_commands(text)]


def built_in_serve_examples() -> list[tuple[str, list[str]]]:
    return [(page, argv) for page, name, argv in commands()
            if name == "serve" and (not argv or argv[0].startswith("-"))]


@pytest.mark.parametrize("page, name, argv", commands(),
                         ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_every_command_parses(page, name, argv):
    try:
        command_parser(name).parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{page}: `carpool {name} {' '.join(argv)}` does not parse (exit {exc.code})")


@pytest.mark.parametrize("page, argv", built_in_serve_examples(),
                         ids=lambda v: v if isinstance(v, str) else " ".join(v) or "(no flags)")
def test_serve_examples_on_the_built_in_model_resolve(page, argv):
    args = serve_parser().parse_args(argv)
    config = EngineConfig.from_cli_args(args)
    server_settings_from_args(args)
    assert config.model is None and config.max_model_len <= 512


@pytest.mark.parametrize("page", PAGES)
def test_there_are_commands_to_check(page):
    names = {name for p, name, _ in commands() if p == page}
    assert names >= EXPECTED[page]
    assert any(p == page for p, _ in built_in_serve_examples())
