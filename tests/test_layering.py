"""The packages depend on each other one way, and only through public names.

Read from the source with ``ast`` (nothing is imported): a package that
imports another's private module or name couples to what that package is
free to change, and two packages importing each other cannot be read or
tested one at a time.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def _imports() -> list[tuple[str, str, list[str]]]:
    """(importing package, imported module, imported names) for every import in src."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        package = path.relative_to(SRC).parts[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append((package, node.module, [a.name for a in node.names]))
            elif isinstance(node, ast.Import):
                found.extend((package, alias.name, []) for alias in node.names)
    return found


def _is_private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def test_no_package_imports_another_packages_private_names() -> None:
    crossing = [
        f"{package} imports {module} {names}"
        for package, module, names in _imports()
        if module.startswith("meshnet_")
        and module.split(".")[0] != package
        and (any(map(_is_private, module.split("."))) or any(map(_is_private, names)))
    ]
    assert crossing == []


def test_the_packages_form_no_cycle() -> None:
    edges: dict[str, set[str]] = {}
    for package, module, _ in _imports():
        target = module.split(".")[0]
        if target.startswith("meshnet_") and target != package:
            edges.setdefault(package, set()).add(target)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(p for p in edges if reaches(p, p, {p}))
    assert cycles == []
