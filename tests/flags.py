"""The flags `carpool serve` takes, read from its parser, and the `carpool` commands a
Markdown page shows (for the README and docs tests)."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex

from carpool.cli import SUBCOMMANDS
from carpool.server import cli as serve_cli


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="carpool serve")
    serve_cli.add_arguments(parser)
    return parser


def serve_flags() -> set[str]:
    return {opt for action in serve_parser()._actions for opt in action.option_strings
            if opt.startswith("--") and opt != "--help"}


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of `carpool NAME`, built as `carpool.cli.main` builds it."""
    module = importlib.import_module(SUBCOMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"carpool {name}", exit_on_error=False)
    module.add_arguments(parser)
    return parser


def doc_commands(markdown: str) -> list[tuple[str, list[str]]]:
    """Every `carpool SUB ARGS...` in the page's ```bash blocks, as (SUB, ARGS): lines
    joined at a trailing backslash, comments dropped, split at `&&`, `&`, `;` and `|`,
    environment assignments before `carpool` skipped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if "carpool " not in line:
                continue
            words = shlex.split(line, comments=True)
            segment: list[str] = []
            for word in words + ["&&"]:
                if word in ("&&", "&", ";", "|", "||"):
                    if len(segment) >= 2 and segment[0] == "carpool" and segment[1] in SUBCOMMANDS:
                        commands.append((segment[1], segment[2:]))
                    segment = []
                elif segment or not re.fullmatch(r"[A-Z_]+=\S*", word):
                    segment.append(word)
    return commands
