"""docs/README.md is the docs' front door (issue 43, point 9): it says where
to start and lists every document in docs/ with one line, so a new document
that is not listed fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INDEX = ROOT / "docs" / "README.md"


def test_the_docs_index_lists_every_document_once() -> None:
    text = INDEX.read_text(encoding="utf-8")
    assert "**Where to start.**" in text
    listed = re.findall(r"^\* \[[^\]]+\]\(([^)#]+)\) — \S", text, re.MULTILINE)
    documents = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    assert sorted(listed) == documents
