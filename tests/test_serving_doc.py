"""docs/serving.md stays true: every `carpool serve` flag is in its table and every flag
there exists, each `carpool` command it shows parses, and its serve examples that use the
built-in model resolve as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from carpool.config import EngineConfig
from carpool.server.cli import server_settings_from_args
from tests.flags import command_parser, doc_commands, serve_flags, serve_parser

SERVING = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()


def table_flags() -> set[str]:
    rows = [line for line in SERVING.splitlines() if line.startswith("| `")]
    return {flag for row in rows for flag in re.findall(r"`(--[a-z0-9-]+)", row.split("|")[1])}


def test_every_serve_flag_is_in_the_table():
    flags = serve_flags()
    help_text = serve_parser().format_help()
    for flag in flags:
        assert flag in help_text
    documented = table_flags()
    missing = {f for f in flags if f not in documented and f != "--num-gpu-blocks-override"
               and not f.startswith("--no-")}
    assert not missing, f"`carpool serve --help` flags not in docs/serving.md's table: {missing}"
    unknown = documented - flags
    assert not unknown, f"docs/serving.md's table has flags `carpool serve` lacks: {unknown}"


@pytest.mark.parametrize("command", doc_commands(SERVING), ids=lambda c: " ".join([c[0], *c[1]]))
def test_every_command_parses(command):
    name, argv = command
    try:
        command_parser(name).parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"`carpool {name} {' '.join(argv)}` does not parse (exit {exc.code})")


def built_in_serve_examples() -> list[list[str]]:
    return [argv for name, argv in doc_commands(SERVING)
            if name == "serve" and (not argv or argv[0].startswith("-"))]


@pytest.mark.parametrize("argv", built_in_serve_examples(),
                         ids=lambda argv: " ".join(argv) or "(no flags)")
def test_serve_examples_on_the_built_in_model_resolve(argv):
    args = serve_parser().parse_args(argv)
    config = EngineConfig.from_cli_args(args)
    server_settings_from_args(args)  # what `carpool serve` checks before binding
    assert config.model is None and config.max_model_len <= 512


def test_there_are_commands_to_check():
    assert len(built_in_serve_examples()) >= 3
    names = {name for name, _ in doc_commands(SERVING)}
    assert names >= {"serve", "bench", "simulate", "tp-worker"}
