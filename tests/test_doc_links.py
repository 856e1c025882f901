"""Every relative link in docs/*.md and README.md resolves: the file exists
and, when the link names an anchor, the target has a heading with that slug.

Links inside fenced code blocks and inline code are not links; http(s) and
mailto links are left to the reader (tests/test_wire2_doc.py keeps the
contract itself free of outside links).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
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
