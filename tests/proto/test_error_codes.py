"""ErrorCode: every stable error code with its status, checked against the
code that raises them and the two documents that list them.

A raise site names its member (``code=ErrorCode.NOT_FOUND``) and the
status follows from it; what keeps the rest honest is the scan here: a code
raised anywhere in src/ is a member (no string literal left), a status
given beside it is one the member allows, and the tables of
docs/core-api.md and docs/wire-2.md §4.2 list exactly the members.
"""

from __future__ import annotations

import ast
import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshnet_proto import (
    CapacityError,
    DownstreamError,
    ErrorCode,
    MeshnetError,
    ProtocolError,
    SequencingError,
)
from meshnet_proto._errors import error_body

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
DOCS = ROOT / "docs"

# The classes' default statuses, for raise sites that give none.
DEFAULTS = {
    cls.__name__: cls.default_status
    for cls in (MeshnetError, ProtocolError, SequencingError, CapacityError, DownstreamError)
}
# Helpers that take the code second (then the status, if anything) and the
# status they give when none is passed (None: the code's own).
HELPERS: dict[str, int | None] = {"_assembly_error": 502, "_error": None}


def _sources(*, conformance: bool = False) -> Iterator[tuple[Path, ast.AST]]:
    for path in sorted(SRC.rglob("*.py")):
        if "openai" in path.parts:  # the OpenAI API's own codes: outside wire 2 (§6)
            continue
        if ("meshnet_conformance" in path.parts) != conformance:
            continue
        yield path, ast.parse(path.read_text(encoding="utf-8"), str(path))


def _name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def _text(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _member(node: ast.AST | None) -> ErrorCode | None:
    """The member a ``ErrorCode.NAME`` expression names."""
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "ErrorCode"
    ):
        return ErrorCode[node.attr]
    return None


def _code(node: ast.AST | None) -> str | None:
    member = _member(node)
    return _text(node) if member is None else member.value


def _raised() -> Iterator[tuple[str, int | None, str]]:
    """(code, status or None when not known statically, where) of every code
    a server of src/ raises: ``code=`` (a member, or a string literal), the
    header parser's ``bad=``/``unsupported=``, and the helpers that take the
    code second. A member without a status beside it answers with its own."""
    for path, tree in _sources():
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call):
                continue
            where = f"{path.relative_to(ROOT)}:{call.lineno}"
            keywords = {kw.arg: kw.value for kw in call.keywords}
            status_node = keywords.get("status")
            status = status_node.value if isinstance(status_node, ast.Constant) else None
            name = _name(call)
            code = _code(keywords.get("code"))
            if code is not None:
                if status_node is None and name in DEFAULTS:
                    member = _member(keywords.get("code"))
                    status = DEFAULTS[name] if member is None else member.status
                yield code, status, where
            for key in ("bad", "unsupported"):
                if (text := _code(keywords.get(key))) is not None:
                    yield text, None, where
            if name in HELPERS and len(call.args) >= 2 and (code := _code(call.args[1])):
                given = call.args[2] if len(call.args) > 2 else status_node
                if given is None:
                    yield code, HELPERS[name] or ErrorCode(code).status, where
                else:
                    yield code, given.value if isinstance(given, ast.Constant) else None, where


def test_a_member_is_its_string_and_carries_its_status() -> None:
    assert ErrorCode.NOT_FOUND == "not_found" and ErrorCode("not_found") is ErrorCode.NOT_FOUND
    assert f"{ErrorCode.SESSIONS_FULL}" == "sessions_full"
    assert (ErrorCode.NOT_FOUND.status, ErrorCode.NOT_FOUND.statuses) == (404, {404})
    assert ErrorCode.CLIENT_SESSIONS_FULL.status == 429
    for member in ErrorCode:
        assert member.value == member.name.lower()
        assert member.status in member.statuses
        assert all(400 <= status <= 599 for status in member.statuses)


def test_only_bad_chunk_index_has_two_statuses() -> None:
    assert {m: m.statuses for m in ErrorCode if len(m.statuses) > 1} == {
        ErrorCode.BAD_CHUNK_INDEX: {400, 502}
    }
    assert ErrorCode.BAD_CHUNK_INDEX.status == 400


def test_a_member_goes_where_a_code_does() -> None:
    error = CapacityError("table full", code=ErrorCode.SESSIONS_FULL, retry_after=1)
    assert error.status == ErrorCode.SESSIONS_FULL.status
    assert json.loads(error_body(error))["error"]["code"] == "sessions_full"
    assert error.code == "sessions_full"


def test_the_status_follows_from_the_code_unless_given() -> None:
    # A ProtocolError's default is 400: the code's own status wins over it.
    error = ProtocolError("no such session", code=ErrorCode.NOT_FOUND)
    assert (error.status, error.code) == (404, "not_found")
    assert repr(error) == (
        "ProtocolError(status=404, code='not_found', header=None, message='no such session')"
    )
    # The code's other status, given where it applies.
    assembly = ProtocolError("index 9 of 4", code=ErrorCode.BAD_CHUNK_INDEX, status=502)
    assert assembly.status == 502
    # A code relayed off the wire as a string keeps its downstream's status,
    # or else gets the class's default: an unknown one as much as a known one.
    assert DownstreamError("x", code="a_newer_code").status == 502
    assert DownstreamError("x", code="not_found", status=404).status == 404


def test_no_raise_site_spells_a_code_as_a_string() -> None:
    # (The conformance checker's expectations are read off the wire: strings.)
    literal = [
        where
        for path, tree in _sources()
        for call in ast.walk(tree)
        if isinstance(call, ast.Call)
        for kw in call.keywords
        if kw.arg in ("code", "bad", "unsupported") and _text(kw.value) is not None
        for where in [path.relative_to(ROOT).as_posix()]
    ]
    # browser_guard.py: an OpenAIError (the OpenAI surface's vocabulary, §6).
    assert literal == ["src/meshnet_gateway/browser_guard.py"]


def test_every_code_raised_in_src_is_a_member() -> None:
    found = {code for code, _, _ in _raised()}
    # Spelt at run time: f"{name}_overflow" for the two half dtypes (_policy.py).
    found |= {"float16_overflow", "bfloat16_overflow"}
    assert len(found) > 55
    assert sorted(found - set(ErrorCode)) == []
    # Every member is raised somewhere (bad_request last: GET /drawn's query, §3.14).
    assert sorted(set(ErrorCode) - found) == []


def test_every_code_is_raised_with_a_status_its_member_allows() -> None:
    wrong = [
        (code, status, where)
        for code, status, where in _raised()
        if status is not None and status not in ErrorCode(code).statuses
    ]
    assert wrong == []


def test_the_conformance_checker_expects_each_code_with_its_status() -> None:
    # Its cases pass (status, code) side by side: expect_error(resp, 409, "x").
    pairs = []
    for path, tree in _sources(conformance=True):
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call):
                continue
            for first, second in itertools.pairwise(call.args):
                code = _text(second)
                if isinstance(first, ast.Constant) and type(first.value) is int and code:
                    pairs.append((first.value, code, f"{path.name}:{call.lineno}"))
    assert len(pairs) > 40
    wrong = [
        (status, code, where)
        for status, code, where in pairs
        if code not in set(ErrorCode) or status not in ErrorCode(code).statuses
    ]
    assert wrong == []


def _core_api_table() -> list[tuple[int, str]]:
    text = (DOCS / "core-api.md").read_text(encoding="utf-8")
    section = text.split("### Stable error codes", 1)[1].split("\n## ", 1)[0]
    return [(int(s), c) for s, c in re.findall(r"^\| (\d{3}) \| `([a-z0-9_]+)` \|", section, re.M)]


def _wire2_table() -> list[tuple[int, str]]:
    text = (DOCS / "wire-2.md").read_text(encoding="utf-8")
    section = text.split("### 4.2 Statuses and codes", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| (\d{3}) \| (.+) \|$", section, re.M)
    return [(int(s), code) for s, codes in rows for code in re.findall(r"`([a-z0-9_]+)`", codes)]


@pytest.mark.parametrize("table", [_core_api_table, _wire2_table], ids=["core-api", "wire-2"])
def test_the_documents_list_every_code_once_with_its_status(table: object) -> None:
    assert callable(table)
    rows = table()
    codes = [code for _, code in rows]
    assert len(codes) == len(set(codes)), "a code listed twice"
    assert sorted(rows) == sorted((member.status, member.value) for member in ErrorCode)
