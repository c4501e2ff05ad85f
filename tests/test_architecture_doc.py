"""docs/ARCHITECTURE.md and docs/cpu.md stay true: the parts table is the import rules of
tests/layers.py and names every part of carpool/, every route is listed, every kernel source
and bound op is in docs/cpu.md, and every path or link either page names exists."""

from __future__ import annotations

import re
from pathlib import Path

from carpool.server.app import ROUTE_MODULES
from tests.layers import ALLOWED

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
ARCHITECTURE = (DOCS / "ARCHITECTURE.md").read_text()
CPU = (DOCS / "cpu.md").read_text()
KERNELS = REPO / "carpool" / "kernels"
# Where a path the docs name may start: the repository, the package, the kernels' sources.
ROOTS = (REPO, REPO / "carpool", KERNELS, KERNELS / "csrc")
FILE_SUFFIXES = (".py", ".cpp", ".h", ".md", ".json")
MAX_ITEM_WORDS = 80  # a bullet of a few lines


def parts_table() -> dict[str, set[str]]:
    """part -> what the table under "Parts and what each may import" says it may import."""
    section = ARCHITECTURE.split("## Parts and what each may import", 1)[1].split("\n## ", 1)[0]
    known = set(ALLOWED) | carpool_parts()
    table: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        allowed = {name.removesuffix(".py").rstrip("/")
                   for name in re.findall(r"`([^`]+)`", cells[2])} & known
        for name in re.findall(r"`([^`]+)`", cells[0]):
            table[name.removesuffix(".py").rstrip("/")] = allowed
    return table


def carpool_parts() -> set[str]:
    """The subpackages and top-level modules of carpool/ (what tests/test_layers.py calls
    parts), without the package's own __init__."""
    root = REPO / "carpool"
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in root.glob("*.py")} - {"__init__"}
    return packages | modules


def test_every_part_is_in_the_parts_table():
    table = parts_table()
    missing = carpool_parts() - set(table)
    assert not missing, f"docs/ARCHITECTURE.md's parts table lacks {sorted(missing)}"
    unknown = set(table) - carpool_parts()
    assert not unknown, f"the parts table names {sorted(unknown)}, which carpool/ lacks"


def test_the_parts_table_is_the_import_rules():
    # A part missing from ALLOWED altogether is tests/test_layers.py's to report.
    for part, allowed in parts_table().items():
        if part not in ALLOWED:
            continue
        assert allowed == ALLOWED[part], (
            f"{part} may import {sorted(ALLOWED[part])} (tests/layers.py); the parts table "
            f"says {sorted(allowed)}")


def test_every_route_is_named():
    ours = {(method, route.path) for module in ROUTE_MODULES for route in module.router.routes
            for method in route.methods if method != "HEAD"}
    assert len(ours) >= 9, ours
    for method, path in ours:
        assert f"`{method} {path}`" in ARCHITECTURE, (
            f"{method} {path} missing from docs/ARCHITECTURE.md's routes")


def test_every_kernel_source_and_op_is_in_the_cpu_page():
    for path in sorted((KERNELS / "csrc").rglob("*")):
        if path.is_file():
            assert path.name in CPU, f"docs/cpu.md does not name csrc/{path.relative_to(KERNELS / 'csrc')}"
    for path in sorted(KERNELS.glob("*.py")):
        if path.stem != "__init__" and path.stem != "__main__":
            assert f"`{path.name}`" in CPU, f"docs/cpu.md does not name carpool/kernels/{path.name}"
    bindings = (KERNELS / "csrc" / "bindings.cpp").read_text()
    bound = set(re.findall(r'm\.def\("(\w+)"', bindings)) | set(
        re.findall(r'py::class_<\w+>\(m, "(\w+)"', bindings))
    assert len(bound) >= 10, bound
    missing = {name for name in bound if f"`{name}" not in CPU}
    assert not missing, f"docs/cpu.md does not name the bound ops {sorted(missing)}"


def named_paths(text: str) -> set[str]:
    """Backticked tokens that are paths: with a slash or a file suffix, no spaces or
    placeholders (`runner/tp_*.py` is a glob)."""
    tokens = set(re.findall(r"`([^`\s]+)`", text))
    return {t for t in tokens
            if ("/" in t or t.endswith(FILE_SUFFIXES)) and not t.startswith(("/", "."))
            and "://" not in t and not re.search(r"[<>{}()?=\\|]", t)}


def resolves(token: str) -> bool:
    """Whether `token` is a file or folder under one of ROOTS (a bare file name: anywhere in
    carpool/), its `module.attribute` tail, if any, defined in that module."""
    token = token.rstrip("/")
    folder, _, name = token.rpartition("/")
    attribute = None
    if not name.endswith(FILE_SUFFIXES) and "." in name:
        name, _, attribute = name.partition(".")
    candidates = [f"{folder}/{name}" if folder else name]
    if attribute is not None or not name.endswith(FILE_SUFFIXES):
        candidates.append(f"{candidates[0]}.py")
    for root in ROOTS:
        for candidate in candidates:
            for path in root.glob(candidate):
                if attribute is None:
                    return True
                if path.is_file() and re.search(
                        rf"^\s*((async\s+)?def|class)\s+{attribute}\b|^\s*{attribute}\s*[:=]",
                        path.read_text(), re.MULTILINE):
                    return True
    return not folder and any((REPO / "carpool").rglob(name))


def test_every_named_path_exists():
    for doc, text in (("ARCHITECTURE.md", ARCHITECTURE), ("cpu.md", CPU)):
        missing = sorted(t for t in named_paths(text) if not resolves(t))
        assert not missing, f"docs/{doc} names paths that do not exist: {missing}"


def test_every_link_resolves():
    for doc, text in (("ARCHITECTURE.md", ARCHITECTURE), ("cpu.md", CPU)):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            assert (DOCS / target).exists(), f"docs/{doc} links {target}, which does not exist"


def prose_items(text: str) -> list[str]:
    """The page's paragraphs and list items (bullets, numbered steps), without its tables,
    code blocks and headings."""
    items: list[list[str]] = [[]]
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            items.append([])
            continue
        if in_code or line.lstrip().startswith(("|", "#")) or not line.strip():
            items.append([])
            continue
        if re.match(r"\s*(-|\d+\.)\s", line):
            items.append([])
        items[-1].append(line)
    return [" ".join(item) for item in items if item]


def test_pages_stay_short():
    # STYLE.md: one page, bullets of a few lines, no measurement diaries.
    for doc, text in (("ARCHITECTURE.md", ARCHITECTURE), ("cpu.md", CPU)):
        assert len(text.splitlines()) <= 300, f"docs/{doc} passed 300 lines"
        for item in prose_items(text):
            words = len(item.split())
            assert words <= MAX_ITEM_WORDS, f"docs/{doc}: {words} words in one item: {item[:70]!r}"
        assert not re.search(r"§\s*\d", text), f"docs/{doc} cites a section: link docs/lab/ instead"
