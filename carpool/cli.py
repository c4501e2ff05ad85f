"""The `carpool` command: one sub-command per job, each in its own module.

Each module named in SUBCOMMANDS exposes `add_arguments(parser)` and
`run(args) -> int`; it is imported only when its sub-command is used, so
`carpool simulate` never pays for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "serve": ("carpool.server.cli", "Run the OpenAI-compatible HTTP server."),
    "generate": ("carpool.generate_cli", "Generate completions for a few prompts offline."),
    "simulate": ("carpool.sim.cli",
                 "Drive the real schedulers with a step-cost model, no model needed."),
    "bench": ("carpool.bench.cli", "Benchmarks: serving load generator and offline comparisons."),
    "tp-worker": ("carpool.tp_worker_cli",
                  "Run one tensor-parallel rank other than 0 (multi-node, env://)."),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="carpool", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in SUBCOMMANDS:
        args = parser.parse_args(argv)  # prints help / the error for an unknown command
        parser.print_help()
        return 2
    module_name, help_text = SUBCOMMANDS[argv[0]]
    module = importlib.import_module(module_name)
    cmd_parser = argparse.ArgumentParser(prog=f"carpool {argv[0]}", description=help_text)
    module.add_arguments(cmd_parser)
    args = cmd_parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
