"""No module of src imports itself back through others at import time.

A cycle between modules makes the import order matter: whichever module is
imported first sees the other half-initialised, and a name that moves breaks
an unrelated import. Read from the source with ``ast`` (nothing is imported):
every import run at module level — in the module body, its ``if``/``try``
blocks and class bodies, not in functions and not under ``TYPE_CHECKING`` —
is an edge to the module it names (``from pkg import sub`` names ``pkg`` and,
when ``sub`` is a module, ``pkg.sub`` too). Importing a submodule also runs
its parents' ``__init__``; those edges are left out, or every package that
re-exports its modules' names would count as a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Every module under ``root``: its dotted name -> (file, is a package)."""
    found: dict[str, tuple[Path, bool]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        package = parts[-1] == "__init__"
        if package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, package)
    return found


def _module_level(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            yield from (i for other in child.orelse for i in _module_level_stmt(other))
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        yield from _module_level(child)


def _module_level_stmt(stmt: ast.stmt) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        yield stmt
    elif not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
        yield from _module_level(stmt)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of ``root`` -> the modules of ``root`` it imports at module level."""
    known = modules(root)
    graph: dict[str, set[str]] = {}
    for name, (path, package) in known.items():
        here = name if package else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in _module_level(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names if alias.name in known)
                continue
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target in known:
                deps.add(target)
            deps.update(
                f"{target}.{alias.name}"
                for alias in node.names
                if f"{target}.{alias.name}" in known
            )
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_src_has_no_module_import_cycle() -> None:
    graph = import_graph(SRC)
    assert len(graph) > 100  # all of src was read
    assert cycles(graph) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_package_and_a_module_importing_it_back_are_a_cycle(tmp_path: Path) -> None:
    # The shape meshnet_conformance had: __init__ re-exports from _runner, and
    # _runner imports its sibling modules through the package (``from . import``).
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from ._runner import run\n",
            "pkg/_runner.py": "from . import cases\nrun = cases\n",
            "pkg/cases.py": "",
        },
    )
    assert cycles(import_graph(tmp_path)) == [["pkg", "pkg._runner"]]


def test_imports_in_functions_and_under_type_checking_are_not_edges(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "a.py": "import b\n",
            "b.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    import a\n"
                "def late():\n    import a\n"
                "class C:\n    def m(self):\n        from a import x\n"
            ),
            "c.py": "try:\n    import d\nexcept ImportError:\n    pass\n",
            "d.py": "class K:\n    import c\n",
        },
    )
    assert import_graph(tmp_path)["b"] == set()
    assert cycles(import_graph(tmp_path)) == [["c", "d"]]
