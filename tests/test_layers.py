"""The package layering docs/ARCHITECTURE.md describes: who may import whom, no cycles,
and engine layers that read their config, never the environment."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.layers import ALLOWED

ROOT = Path(__file__).resolve().parents[1] / "carpool"

ENGINE_LAYERS = ("core", "engine", "models", "attention", "platform", "runner", "structured",
                 "distributed", "config/", "outputs.py")


def part_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_parts(path: Path) -> set[str]:
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            pieces = name.split(".")
            if pieces[0] == "carpool" and len(pieces) > 1:
                parts.add(pieces[1])
    return parts


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        part = part_of(path)
        edges.setdefault(part, set()).update(imported_parts(path) - {part})
    return edges


def test_each_part_imports_only_what_it_may():
    for part, targets in graph().items():
        assert part in ALLOWED, f"new part {part}: add it to ALLOWED and docs/ARCHITECTURE.md"
        extra = targets - ALLOWED[part]
        assert not extra, f"carpool.{part} imports {sorted(extra)}, outside its layer"


def test_no_cycles_between_parts():
    edges = graph()
    for part, targets in edges.items():
        for target in targets:
            assert part not in reachable(edges, target), f"cycle through {part} and {target}"


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        for nxt in edges.get(node, ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_engine_layers_never_read_the_environment():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(ENGINE_LAYERS):
            continue
        text = path.read_text()
        for needle in ("os.environ", "os.getenv", "getenv("):
            assert needle not in text, f"{rel} reads the environment ({needle})"
