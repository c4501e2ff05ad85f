"""The flags `carpool serve` takes, read from its parser (for the README and docs tests)."""

from __future__ import annotations

import argparse

from carpool.server import cli as serve_cli


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="carpool serve")
    serve_cli.add_arguments(parser)
    return parser


def serve_flags() -> set[str]:
    return {opt for action in serve_parser()._actions for opt in action.option_strings
            if opt.startswith("--") and opt != "--help"}
