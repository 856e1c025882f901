"""The README and docs/ lead a newcomer to every feature (issue 42).

What went stale before: runtime.md's module table missed ten of the
runtime's modules, the README named one of the six scripts in
``benchmarks/`` and none of ``meshnet bench``'s sections by name. Held here:

* every module of ``src/meshnet_runtime`` has a row in runtime.md's module
  table, and every row names a module that exists;
* every file in docs/ is linked from docs/README.md or the README;
* every ``meshnet bench`` section is named (a code span) in the README's
  paragraph on the bench, and every script in ``benchmarks/`` in the README.
"""

from __future__ import annotations

import re
from pathlib import Path

from meshnet_bench.runner import SECTIONS
from tests.repo.test_doc_links import links

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RUNTIME = ROOT / "src" / "meshnet_runtime"


def _runtime_table_modules() -> list[str]:
    text = (ROOT / "docs" / "runtime.md").read_text(encoding="utf-8")
    table = text[text.index("| module | concern |") :].split("\n\n", 1)[0]
    return re.findall(r"^\| `([a-z_]+)` \|", table, re.MULTILINE)


def test_runtime_md_lists_every_runtime_module() -> None:
    modules = {p.stem for p in RUNTIME.glob("*.py") if p.stem != "__init__"}
    modules |= {p.parent.name for p in RUNTIME.glob("*/__init__.py")}  # a package: one row
    listed = _runtime_table_modules()
    assert sorted(modules - set(listed)) == [], "modules missing from runtime.md's table"
    assert sorted(set(listed) - modules) == [], "rows of runtime.md's table with no module"
    assert len(listed) == len(set(listed)), "a module listed twice"


def test_every_file_in_docs_is_linked_from_an_index() -> None:
    linked = set()
    for index in (ROOT / "docs" / "README.md", README):
        for target in links(index):
            linked.add((index.parent / target.partition("#")[0]).resolve())
    files = {p.resolve() for p in (ROOT / "docs").iterdir() if p.name != "README.md"}
    assert sorted(p.name for p in files - linked) == []


def _bench_paragraph() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index("`meshnet bench` runs every comparison")
    return text[start : text.index("\n\n", start)]


def test_the_readme_names_every_bench_section_and_script() -> None:
    named = set(re.findall(r"`([a-z0-9]+)`", _bench_paragraph()))
    assert [section for section in SECTIONS if section not in named] == []
    readme = README.read_text(encoding="utf-8")
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
    assert [name for name in scripts if f"`{name}`" not in readme] == []
