"""No room of ``src/`` grows back into four jobs (issues 21 and 42).

The limits the house was put in order to: no file over 500 lines, no class
over 350, no function over 80. They drifted once already, when three
branches each added a little to the gateway (``GatewayApp`` reached 359
lines): this test says so at once, naming the place.

The sizes are those of the source as ``ruff format`` writes it with every
``# fmt: skip`` and ``# fmt: off``/``# fmt: on`` taken out (issue 42): a
limit met by packing lines under ``fmt: skip`` is not met. The one kept
exception is a table that reads better aligned, and it says so on its line,
``# fmt: skip  # aligned table: <why>``; those are few (``MAX_SKIPS``).
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
LIMITS = {"file": 500, "class": 350, "function": 80}
MAX_SKIPS = 40

# A skip the formatter honours and this test keeps: an aligned table, with
# the reason on the same line.
KEPT = re.compile(r"#\s*fmt:\s*skip\s+#\s*aligned table:\s*\S.{7,}$")
# Any other formatter pragma is taken out before measuring.
PRAGMA = re.compile(r"\s*#\s*fmt:\s*(skip|off|on)\b.*$")

# Folders whose packed lines are still being taken apart in another branch
# (issue 42): their skips are measured as written, and their count may only
# fall. Empty this when that work lands.
PENDING: dict[str, int] = {}


def _pending(name: str) -> str | None:
    return next((folder for folder in PENDING if name.startswith(folder + "/")), None)


def _unpacked(text: str) -> str:
    """The source with every formatter pragma but a kept table's removed."""
    lines = []
    for line in text.splitlines():
        if KEPT.search(line):
            lines.append(line)
            continue
        stripped = PRAGMA.sub("", line)
        # A pragma alone on its line (``# fmt: off``) goes with the line; a
        # trailing one leaves the code it followed.
        if stripped.strip() or not line.strip():
            lines.append(stripped)
    return "\n".join(lines) + "\n"


@functools.cache  # one formatter run for the whole module
def _formatted() -> dict[str, str]:
    """Each module of ``src/`` as ``ruff format`` writes it, unpacked."""
    with tempfile.TemporaryDirectory() as tmp:
        copies: dict[str, Path] = {}
        for path in sorted(SRC.rglob("*.py")):
            name = path.relative_to(SRC).as_posix()
            text = path.read_text(encoding="utf-8")
            copy = Path(tmp) / name
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(text if _pending(name) else _unpacked(text), encoding="utf-8")
            copies[name] = copy
        subprocess.run(
            [
                sys.executable,
                "-m",
                "ruff",
                "format",
                "--quiet",
                "--config",
                str(ROOT / "pyproject.toml"),
                tmp,
            ],
            check=True,
        )
        return {name: copy.read_text(encoding="utf-8") for name, copy in copies.items()}


def _sizes(sources: dict[str, str]) -> list[tuple[str, str, int]]:
    found: list[tuple[str, str, int]] = []
    for name, text in sources.items():
        found.append(("file", name, len(text.splitlines())))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                kind = "class"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "function"
            else:
                continue
            assert node.end_lineno is not None
            found.append((kind, f"{name}:{node.name}", node.end_lineno - node.lineno + 1))
    return found


def _skips() -> dict[str, list[str]]:
    """Each ``fmt:`` pragma line in ``src/``, ``path:line``, by folder kind."""
    found: dict[str, list[str]] = {"kept": [], "unexplained": [], **{f: [] for f in PENDING}}
    for path in sorted(SRC.rglob("*.py")):
        name = path.relative_to(SRC).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not PRAGMA.search(line):
                continue
            where = f"{name}:{number}"
            folder = _pending(name)
            if folder is not None:
                found[folder].append(where)
            else:
                found["kept" if KEPT.search(line) else "unexplained"].append(where)
    return found


def test_no_file_class_or_function_over_its_limit() -> None:
    over = [
        f"{kind} {where}: {lines} lines formatted (limit {LIMITS[kind]})"
        for kind, where, lines in _sizes(_formatted())
        if lines > LIMITS[kind]
    ]
    assert not over, "split it by its jobs:\n" + "\n".join(over)


def test_the_walk_sees_every_kind() -> None:
    # A walk that found nothing would pass the limits vacuously.
    sizes = _sizes(_formatted())
    assert {kind for kind, _, _ in sizes} == set(LIMITS)
    assert len([s for s in sizes if s[0] == "file"]) > 150


def test_unpacking_measures_the_formatters_lines() -> None:
    # The measure is the formatter's: a packed line counts as what it unpacks to.
    packed = "def f(): return [1,\n  2]  # fmt: skip\n"
    assert _unpacked(packed) == "def f(): return [1,\n  2]\n"
    kept = "X = [1,  2]  # fmt: skip  # aligned table: columns line up by field\n"
    assert _unpacked(kept) == kept
    assert _unpacked("# fmt: off\nx = 1\n# fmt: on\n") == "x = 1\n"


def test_fmt_skip_only_for_aligned_tables_with_a_reason() -> None:
    skips = _skips()
    assert not skips["unexplained"], (
        "let ruff format write these lines, or say why the table reads better aligned "
        "(`# fmt: skip  # aligned table: <why>`):\n" + "\n".join(skips["unexplained"])
    )
    assert len(skips["kept"]) <= MAX_SKIPS, skips["kept"]
    for folder, ceiling in PENDING.items():
        # Reported apart until its own branch lands; it may only go down.
        assert len(skips[folder]) <= ceiling, f"{folder}: {len(skips[folder])} skips"
