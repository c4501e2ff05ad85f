"""docs/ARCHITECTURE.md names every serve and generate flag, every route, and every part."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from carpool import generate_cli
from carpool.server.app import ROUTE_MODULES
from tests.flags import serve_flags
from tests.layers import ALLOWED

DOC = (Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md").read_text()


def test_every_serve_and_generate_flag_is_named():
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    parser.format_help()  # a stray % in a help string breaks --help
    generate_flags = {opt for a in parser._actions for opt in a.option_strings
                      if opt.startswith("--") and opt != "--help"}
    missing = {f for f in serve_flags() | generate_flags if f"`{f}`" not in DOC}
    assert not missing, f"docs/ARCHITECTURE.md does not name {sorted(missing)}"


def test_every_route_is_named():
    ours = {(method, route.path) for module in ROUTE_MODULES for route in module.router.routes
            for method in route.methods if method != "HEAD"}
    assert len(ours) >= 9, ours
    for method, path in ours:
        assert re.search(rf"`{method} [^`]*{re.escape(path)}`", DOC) or (
            f"`{method} {path}`" in DOC), f"{method} {path} missing from docs/ARCHITECTURE.md"


def test_every_part_is_in_the_layer_table():
    for part in ALLOWED:
        if part in ("__init__", "utils", "testing", "default_model_path", "cli"):
            continue
        assert f"`{part}" in DOC, f"part {part} missing from docs/ARCHITECTURE.md"
