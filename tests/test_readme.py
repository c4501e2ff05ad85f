"""README stays true: every `carpool serve` flag is in its table, and its serve examples
that use the built-in model resolve as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from carpool.config import EngineConfig
from carpool.server.cli import server_settings_from_args
from tests.flags import serve_flags, serve_parser

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def readme_table_flags() -> set[str]:
    rows = [line for line in README.splitlines() if line.startswith("| `")]
    return {flag for row in rows for flag in re.findall(r"`(--[a-z0-9-]+)", row.split("|")[1])}


def test_every_serve_flag_is_in_the_readme_table():
    flags = serve_flags()
    help_text = serve_parser().format_help()
    for flag in flags:
        assert flag in help_text
    documented = readme_table_flags()
    missing = {f for f in flags if f not in documented and f != "--num-gpu-blocks-override"
               and not f.startswith("--no-")}
    assert not missing, f"flags of `carpool serve --help` missing from README's table: {missing}"
    unknown = documented - flags
    assert not unknown, f"README's table lists flags `carpool serve` does not have: {unknown}"


def serve_examples() -> list[list[str]]:
    text = README.replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        line = line.split("#")[0].split("&")[0].strip()
        if line.startswith("carpool serve"):
            commands.append(shlex.split(line)[2:])
    return commands


@pytest.mark.parametrize("argv", [a for a in serve_examples() if not a or a[0].startswith("-")],
                         ids=lambda argv: " ".join(argv) or "(no flags)")
def test_serve_examples_on_the_built_in_model_resolve(argv):
    args = serve_parser().parse_args(argv)
    config = EngineConfig.from_cli_args(args)
    server_settings_from_args(args)  # what `carpool serve` checks before binding
    assert config.model is None and config.max_model_len <= 512


def test_there_are_built_in_serve_examples():
    assert sum(1 for a in serve_examples() if not a or a[0].startswith("-")) >= 2
