"""docs/serving.md stays true: every `carpool serve` flag is in its table and every flag
there exists. (Its commands: `tests/test_doc_commands.py`.)"""

from __future__ import annotations

import re
from pathlib import Path

from tests.flags import serve_flags, serve_parser

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


