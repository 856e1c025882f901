"""h11's private state is touched in one module, meshnet_proto/_h11_shim.py.

Issue 42: the core had come to reach into h11's internals in five places
while pyproject allows three h11 minors. The shim probes each touch at
import and falls back to the public path; everything else goes through
h11's public API. Read from the source with ``ast`` (nothing of ours is
imported): h11's private names are those its own source defines — its
``_modules``, ``_functions``, ``self._attributes`` and ``_keyword``
parameters — and a module of ours uses one when it imports from a private
h11 module, reads ``h11._x``, passes an h11 ``_keyword``, or reads one of
those attribute names off anything but its own ``self``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import h11

SRC = Path(__file__).resolve().parents[2] / "src"
SHIM = "meshnet_proto/_h11_shim.py"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id == "self"


def _h11_private_names() -> set[str]:
    names = set()
    for path in Path(h11.__file__).parent.glob("*.py"):
        names.add(path.stem)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.FunctionDef):
                names.update(a.arg for a in [*node.args.args, *node.args.kwonlyargs])
            elif isinstance(node, ast.Attribute) and _on_self(node):
                names.add(node.attr)
    return {name for name in names if _is_private(name)}


def _imports_h11(tree: ast.AST) -> bool:
    return any(
        (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "h11" for a in node.names))
        or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "h11")
        for node in ast.walk(tree)
    )


def _private_uses(tree: ast.AST, private: set[str]) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _imports_private(node):
            found.append(f"line {node.lineno}: from {node.module} import …")
        elif isinstance(node, ast.Attribute) and _reads_private(node, private):
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.keyword) and node.arg in private:
            found.append(f"line {node.lineno}: {node.arg}=")
    return found


def _imports_private(node: ast.ImportFrom) -> bool:
    module = (node.module or "").split(".")
    return module[0] == "h11" and any(map(_is_private, [*module, *(a.name for a in node.names)]))


def _reads_private(node: ast.Attribute, private: set[str]) -> bool:
    owner = node.value.id if isinstance(node.value, ast.Name) else None
    if owner == "h11":
        return _is_private(node.attr)
    return node.attr in private and owner not in ("self", "cls")  # our own attributes


def test_the_scan_knows_h11s_private_names() -> None:
    private = _h11_private_names()
    assert {"_readers", "_reader", "_remaining", "_full_items", "_parsed"} <= private
    assert {"_cstate", "_request_method", "_body_framing"} <= private
    old = ast.parse(
        "import h11\nfrom h11._connection import _body_framing\n"
        "h11.Response(status_code=200, headers=[], _parsed=True)\n"
        "def f(conn, headers): return conn._reader._remaining, headers._full_items\n"
        "def g(self): return self._body, h11._headers.Headers\n"
    )
    assert len(_private_uses(old, private)) == 6  # self._body is ours


def test_only_the_shim_touches_h11s_private_state() -> None:
    private = _h11_private_names()
    touching = {}
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        if _imports_h11(tree) and (uses := _private_uses(tree, private)):
            touching[path.relative_to(SRC).as_posix()] = uses
    assert set(touching) == {SHIM}, touching
