"""The packages depend on each other one way, and only through public names.

Read from the source with ``ast`` (nothing is imported): a package that
imports another's private module or name couples to what that package is
free to change, and two packages importing each other cannot be read or
tested one at a time.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


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


def test_the_shared_layers_know_no_role() -> None:
    """The core and the runtime serve both roles: what is a node's or a
    gateway's (their flags, NodeConfig and GatewayConfig) lives beside its
    server, and nothing below imports it."""
    upward = [
        f"{package} imports {module}"
        for package, module, _ in _imports()
        if package in ("meshnet_proto", "meshnet_runtime")
        and module.split(".")[0] in ("meshnet_node", "meshnet_gateway", "meshnet_cli")
    ]
    assert upward == []


# -- inside meshnet_model: modules layered one way, and no cycle ----------------------

MODEL = SRC / "meshnet_model"

# A module imports at run time only modules of its own layer or one below:
# errors, progress <- formats, rope <- source <- stage <- engines <- plan, testing, the facade.
_LAYERS = {
    "errors": 0,
    "progress": 0,  # a load's progress: imports nothing of ours, the readers report to it
    "sampling": 0,  # drawing a token from logits (the gateway's and the last stage's)
    "formats": 1,
    "rope": 1,
    "speculative": 1,  # verifying a drafted window, over sampling's draw (issue 38)
    "source": 2,
    "stage": 3,
    "engines": 4,
    "identity": 4,  # digests over formats and stage.weights' rule of what a stage holds
    "plan": 5,
    "split": 5,  # the one split of plan and meshnet run, over engines.footprint
    "testing": 5,
    "__main__": 5,
    "": 5,  # meshnet_model/__init__.py, the public names
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _model_imports() -> list[tuple[str, str, str]]:
    """(importing module, imported meshnet_model module, how) for every import
    inside meshnet_model; how is "runtime" (run when the module is imported),
    "lazy" (inside a function) or "typing" (under ``if TYPE_CHECKING:``)."""
    paths = sorted(MODEL.rglob("*.py"))
    known = {_module_name(p) for p in paths}
    found = []
    for path in paths:
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]

        def visit(node: ast.AST, how: str, name: str = name, package: str = package) -> None:
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    module = f"{base}.{node.module}" if node.module else base
                else:
                    module = node.module or ""
                for alias in node.names:  # `from . import x` names a module
                    target = f"{module}.{alias.name}"
                    found.append((name, target if target in known else module, how))
            elif isinstance(node, ast.Import):
                found.extend((name, alias.name, how) for alias in node.names)
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                    visit(child, "lazy")
                elif isinstance(child, ast.If) and _is_type_checking(child):
                    for stmt in child.body:
                        visit(stmt, "typing" if how == "runtime" else how)
                    for stmt in child.orelse:
                        visit(stmt, how)
                else:
                    visit(child, how)

        visit(ast.parse(path.read_text(), str(path)), "runtime")
    return [(a, b, how) for a, b, how in found if b.split(".")[0] == "meshnet_model"]


def _layer(module: str) -> int:
    return _LAYERS[module.removeprefix("meshnet_model").lstrip(".").split(".")[0]]


def test_the_model_modules_are_all_in_a_layer() -> None:
    for path in MODEL.rglob("*.py"):
        _layer(_module_name(path))  # a KeyError names a module _LAYERS lacks


def test_model_modules_import_at_run_time_only_their_layer_or_below() -> None:
    upward = [
        f"{module} imports {target}"
        for module, target, how in _model_imports()
        if how == "runtime" and _layer(target) > _layer(module)
    ]
    assert upward == []


def test_errors_imports_nothing_of_ours_and_formats_no_stage_or_engine() -> None:
    wrong = [
        f"{module} imports {target} ({how})"
        for module, target, how in _model_imports()
        if module == "meshnet_model.errors"
        or (_layer(module) <= 1 and _layer(target) >= 3)  # even lazily, even for typing
    ]
    assert wrong == []


def test_the_model_modules_form_no_import_cycle() -> None:
    # Every import counts, lazy and typing-only ones too: a cycle hidden in a
    # function is still two modules that cannot be read one without the other.
    edges: dict[str, set[str]] = {}
    for module, target, _ in _model_imports():
        if target != module:
            edges.setdefault(module, set()).add(target)

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        seen: set[str] = set()
        while stack:
            node, path = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    return [*path, nxt]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
        return None

    cycles = [cycle for m in sorted(edges) if (cycle := cycle_from(m))]
    assert cycles == []
