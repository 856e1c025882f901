"""Every relative link in docs/*.md and README.md resolves: the file exists
and, when the link names an anchor, the target has a heading with that slug.

Links inside fenced code blocks and inline code are not links; http(s) and
mailto links are left to the reader (tests/test_wire2_doc.py keeps the
contract itself free of outside links).

Also held to the code here, one sentence that had gone stale: what
``meshnet_model`` imports, as docs/models.md and its package docstring say.
"""

from __future__ import annotations

import ast
import re
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
# [text](target) and ![alt](target), target up to the first space or ")".
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
_EXTERNAL = ("http://", "https://", "mailto:")


def _prose(text: str) -> str:
    """The text without its code blocks and code spans."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped,
    lowercase, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, title in _HEADING.findall(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        slug = _slug(title)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(found)


def links(path: Path) -> list[str]:
    return _LINK.findall(_prose(path.read_text(encoding="utf-8")))


def test_the_slugs_are_githubs() -> None:
    assert _slug("13. Decisions") == "13-decisions"
    assert _slug("`ServerConnection`") == "serverconnection"
    assert _slug("Errors (`_errors.py`)") == "errors-_errorspy"
    assert _slug("Every limit and its default") == "every-limit-and-its-default"
    assert _slug("The model surface (issue 13)") == "the-model-surface-issue-13"


def test_the_scan_sees_links_and_skips_code() -> None:
    sample = "see [a](x.md#b) and `[c](nope.md)`\n```\n[d](nope.md)\n```\n![e](f.png)\n"
    assert _LINK.findall(_prose(sample)) == ["x.md#b", "f.png"]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_relative_link_resolves(document: Path) -> None:
    broken = []
    for target in links(document):
        if target.startswith(_EXTERNAL):
            continue
        file_part, _, anchor = target.partition("#")
        path = (document.parent / file_part).resolve() if file_part else document
        if not path.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {path.name}")
    assert broken == [], f"{document.name}: broken links:\n" + "\n".join(broken)


def test_no_document_is_a_stub() -> None:
    # A page that only points elsewhere is a link kept alive for nothing:
    # repoint the links and delete it.
    stubs = [
        path.name
        for path in DOCUMENTS
        if len(path.read_text(encoding="utf-8").strip().splitlines()) < 10
    ]
    assert stubs == []


def _third_party_imports(package: Path) -> set[str]:
    found = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names}


def test_the_model_package_imports_what_its_docs_say() -> None:
    imported = _third_party_imports(ROOT / "src" / "meshnet_model")
    assert not any(name.startswith("meshnet_") for name in imported)  # no wire, no runtime
    said = {
        "docs/models.md": (ROOT / "docs" / "models.md").read_text(encoding="utf-8"),
        "meshnet_model/__init__.py": (ROOT / "src" / "meshnet_model" / "__init__.py").read_text(
            encoding="utf-8"
        ),
    }
    for where, text in said.items():
        match = re.search(r"imports ((?:[a-z_]+, )+[a-z_]+ and [a-z_]+)", " ".join(text.split()))
        assert match, f"{where}: no sentence saying what meshnet_model imports"
        listed = set(re.split(r", | and ", match.group(1)))
        assert listed | {"torch"} == imported, (
            f"{where} says meshnet_model imports {sorted(listed)} (and torch in its engine); "
            f"it imports {sorted(imported)}"
        )
