"""Roles are Protocols, not lookups (issue 21 part 3).

A server holds its hop below as a ``meshnet_runtime.downstream.Downstream``
and its stage as a ``meshnet_node.backends.StageBackend``; every
implementation has every method (a single node's pool has the replica-only
ones as trivial methods, a stub stage a ``check_head`` that refuses
nothing). So nothing in src asks which implementation it holds
(``isinstance(x, ReplicaSet)``) or whether an object has a hook
(``getattr(x, "hook", None)``): mypy checks the protocols instead.

Read from the source with ``ast`` (nothing is imported).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# The implementations a server must not tell apart.
IMPLEMENTATIONS = frozenset({"ReplicaSet", "DownstreamPool"})

# getattr(x, "literal") calls that are not a hook lookup: (file under src, attribute).
# An entry no call uses any more fails too, so the list only shrinks on purpose.
GETATTR_ALLOWED = {
    # gguf's tensor_type is an enum member or a bare int in older gguf
    # releases: its name when it has one.
    ("meshnet_model/engines/held_bytes.py", "name"),
    ("meshnet_model/identity.py", "name"),
    # An engine's KV element size (engines predating it store float32);
    # meshnet_model's engine protocol is outside issue 21 part 3.
    ("meshnet_model/stage/contract.py", "kv_itemsize"),
    # argparse namespaces shared by subcommands that do not all define the flag.
    ("meshnet_cli/send.py", "session_key"),
    # A benchmark section module's optional KEYS constant (what a failed
    # section still lists).
    ("meshnet_bench/runner.py", "KEYS"),
    # Its optional needs(options): what it requires beyond the base install
    # (torch, the model package), checked before it starts. Sections are
    # modules, not objects of a Protocol, as KEYS above.
    ("meshnet_bench/runner.py", "needs"),
    # A flag kind's choices: an enum-like kind has them, int/float/str do not.
    ("meshnet_runtime/config.py", "choices"),
    # h11's private reader state (the body bypass reads how much is left;
    # the shim probes it at import, tests/repo/test_h11_private.py).
    ("meshnet_proto/_h11_shim.py", "_reader"),
    ("meshnet_proto/_h11_shim.py", "_remaining"),
    # fcntl's open-file-description lock commands exist on Linux only.
    ("meshnet_model/engines/core_ledger.py", "F_OFD_SETLK"),
    ("meshnet_model/engines/core_ledger.py", "F_OFD_GETLK"),
}

# isinstance(x, ReplicaSet | DownstreamPool) that is not a server telling its
# implementations apart: (file under src, class).
ISINSTANCE_ALLOWED = {
    # The failover benchmark built a replica set below its entry node and
    # narrows the node's Downstream to read the set's own counters.
    ("meshnet_bench/failover.py", "ReplicaSet"),
}


def _calls(name: str) -> list[tuple[str, int, ast.Call]]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        where = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == name
            ):
                found.append((where, node.lineno, node))
    return found


def _names(node: ast.expr) -> set[str]:
    """The class names in an isinstance's second argument (a name, a tuple, a union)."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.Tuple):
        return set().union(*(_names(e) for e in node.elts))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _names(node.left) | _names(node.right)
    return set()


def _literal_getattrs() -> list[tuple[str, int, str]]:
    return [
        (where, line, call.args[1].value)
        for where, line, call in _calls("getattr")
        if len(call.args) >= 2
        and isinstance(call.args[1], ast.Constant)
        and isinstance(call.args[1].value, str)
    ]


def test_no_hook_is_looked_up_by_name() -> None:
    found = [
        f"{where}:{line}: getattr(..., {attr!r})"
        for where, line, attr in _literal_getattrs()
        if (where, attr) not in GETATTR_ALLOWED
    ]
    assert not found, "make the hook a method of the role's Protocol:\n" + "\n".join(found)


def test_no_hook_is_probed_with_hasattr() -> None:
    found = [
        f"{where}:{line}: hasattr(...)"
        for where, line, call in _calls("hasattr")
        if len(call.args) == 2 and isinstance(call.args[1], ast.Constant)
    ]
    assert not found, "make the hook a method of the role's Protocol:\n" + "\n".join(found)


def test_no_server_asks_which_downstream_it_holds() -> None:
    found = [
        f"{where}:{line}: isinstance(..., {cls})"
        for where, line, call in _calls("isinstance")
        if len(call.args) == 2
        for cls in sorted(_names(call.args[1]) & IMPLEMENTATIONS)
        if (where, cls) not in ISINSTANCE_ALLOWED
    ]
    assert not found, "use the Downstream Protocol's method instead:\n" + "\n".join(found)


def test_the_scan_finds_what_it_looks_for() -> None:
    """The scan itself: it sees the allowed calls (so it reads src at all),
    and a hook lookup or an implementation check in a snippet."""
    assert ("meshnet_model/identity.py", "name") in {(w, a) for w, _, a in _literal_getattrs()}
    snippet = ast.parse(
        'getattr(stage, "check_head", None)\nisinstance(pool, (ReplicaSet, int))\n'
        "isinstance(pool, DownstreamPool | ReplicaSet)"
    )
    calls = [n for n in ast.walk(snippet) if isinstance(n, ast.Call)]
    getattrs = [c for c in calls if isinstance(c.func, ast.Name) and c.func.id == "getattr"]
    assert getattrs[0].args[1].value == "check_head"  # type: ignore[attr-defined]
    checks = [c for c in calls if isinstance(c.func, ast.Name) and c.func.id == "isinstance"]
    assert [_names(c.args[1]) & IMPLEMENTATIONS for c in checks] == [
        {"ReplicaSet"},
        {"DownstreamPool", "ReplicaSet"},
    ]


def test_every_allowance_is_still_used() -> None:
    used = {(where, attr) for where, _, attr in _literal_getattrs()}
    checked = {
        (where, cls)
        for where, _, call in _calls("isinstance")
        if len(call.args) == 2
        for cls in _names(call.args[1]) & IMPLEMENTATIONS
    }
    stale = sorted((GETATTR_ALLOWED - used) | (ISINSTANCE_ALLOWED - checked))
    assert not stale, f"remove these allowances, nothing needs them now: {stale}"
