"""docs/core-api.md against the code: what it names exists, and what the code
offers is named.

The document is read as code spans (inline and in its ```python blocks),
each section tied to the classes it describes. Checked:

* every name of ``meshnet_proto.__all__`` and ``meshnet_proto.lowlevel.__all__``
  is described outside the *Public names* tables (a code span);
* every ``meshnet_proto.X`` / ``meshnet_runtime.sequencing.X`` / ``_module.X``
  and every ``Class.attr`` the document writes exists;
* every signature it writes (``Name(a, *, b=...)``, a section's
  ``method(a, b)``) names only parameters the code takes, and together the
  signatures of one callable name all of them;
* every ``.attr``, ``name(...)`` or ``name: type`` span in a class's section
  is an attribute of that class;
* the events' fields, the public methods and properties of the two
  connections and of ``SessionTable``, the fields of ``WireHeaders`` and of
  ``Limits`` (with their defaults) are all documented;
* the modules table lists exactly the core's private modules;
* the fenced driver loops call only methods their objects have.

A failure names each missing item.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import meshnet_proto
from meshnet_proto import lowlevel

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "core-api.md").read_text(encoding="utf-8")
CORE = ROOT / "src" / "meshnet_proto"

_MISSING = object()


# ---------------------------------------------------------------- the code


@cache
def registry() -> dict[str, Any]:
    """Every name the document may write bare: the core's public and
    second-tier names, each private module's own ``__all__``, and the
    runtime's ``SequencedTable``."""
    names: dict[str, Any] = {}
    for path in sorted(CORE.glob("_*.py")):
        if path.stem == "__init__":
            continue
        module = importlib.import_module(f"meshnet_proto.{path.stem}")
        for name in getattr(module, "__all__", ()):
            names[name] = getattr(module, name)
    for module in (meshnet_proto, lowlevel):
        for name in module.__all__:
            names[name] = getattr(module, name)
    sequencing = _import("meshnet_runtime.sequencing")
    if sequencing is not _MISSING and hasattr(sequencing, "SequencedTable"):
        names["SequencedTable"] = sequencing.SequencedTable
    return names


def _import(dotted: str) -> Any:
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError:
        return _MISSING


@cache
def instance_attributes(cls: type) -> frozenset[str]:
    """``self.x = ...`` in the class's own methods (attributes a plain
    ``getattr`` on the class does not see)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return frozenset()
    found = set()
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                found.add(target.attr)
    return frozenset(found)


def member(owner: Any, name: str) -> Any:
    """``owner.name`` as the document means it: a class attribute, a
    dataclass field, or an attribute its methods set."""
    value = getattr(owner, name, _MISSING)
    if value is not _MISSING:
        return value
    if isinstance(owner, type):
        if dataclasses.is_dataclass(owner) and name in {f.name for f in dataclasses.fields(owner)}:
            return name
        if name in instance_attributes(owner):
            return name
    return _MISSING


def resolve(dotted: str) -> Any:
    """The object a dotted name of the document means, or ``_MISSING``."""
    parts = dotted.split(".")
    if parts[0] in ("meshnet_proto", "meshnet_runtime"):
        # the longest importable module prefix, then attributes
        for cut in range(len(parts), 0, -1):
            obj = _import(".".join(parts[:cut]))
            if obj is not _MISSING:
                break
        else:
            return _MISSING
        rest = parts[cut:]
    elif parts[0].startswith("_"):
        obj = _import(f"meshnet_proto.{parts[0]}")
        rest = parts[1:]
    else:
        obj = registry().get(parts[0], _MISSING)
        rest = parts[1:]
    for part in rest:
        if obj is _MISSING:
            break
        obj = member(obj, part)
    return obj


def parameters(obj: Any) -> set[str] | None:
    """The parameter names a callable takes (None: not introspectable)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return {
        p.name
        for p in signature.parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


# ---------------------------------------------------------------- the document

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_HEADING = re.compile(r"^(#{2,3}) (.+)$", re.MULTILINE)
_SPAN = re.compile(r"`([^`]+)`")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DOTTED = re.compile(r"^_?[A-Za-z][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
_SIGNATURE = re.compile(r"^(\.?[A-Za-z_][A-Za-z0-9_.]*)\((.*)\)\s*(?:->.*)?$", re.DOTALL)
_FIELD = re.compile(r"^\.?([a-z_][a-z0-9_]*)(?::\s|\s*->|\s*\(property\))")


@dataclasses.dataclass
class Section:
    title: str
    level: int
    prose: str  # the text outside fenced blocks
    code: list[tuple[str, str]]  # fenced blocks: (language, text)
    classes: tuple[str, ...] = ()

    def spans(self) -> list[str]:
        return [" ".join(s.split()) for s in _SPAN.findall(self.prose)]

    def words(self) -> set[str]:
        """Every identifier in a code span or a fenced block of the section."""
        text = " ".join(self.spans()) + " ".join(body for _, body in self.code)
        return set(_IDENT.findall(text))


# Which classes each section describes (a title's start; a ### inherits its ##'s).
_SECTION_CLASSES = {
    "Errors": ("MeshnetError", "ErrorCode"),
    "Stable error codes": ("ErrorCode",),
    "Limits": ("Limits",),
    "Byte budget": ("ByteBudget", "Reservation"),
    "Headers": ("WireHeaders",),
    "Codec": (),
    "Policies": ("WireDtypePolicy", "EncodingPolicy"),
    "Chunking": ("ChunkAssembler", "Chunk"),
    "The `SessionTable` contract": ("SessionTable", "SequencedTable", "Wait", "Ticket"),
    "What a node answers beside its stage": ("NodeControl",),
    "The gateway's sessions": ("ClientSessionTable", "Lease"),
    "The chain check": ("StageIdentity", "StageReport", "ChainProblem"),
    "Events and connections": (
        "ActivationHead",
        "ActivationReceived",
        "EndpointRequest",
        "ProtocolErrorReceived",
        "ConnectionClosed",
        "ActivationResponse",
        "ErrorResponse",
        "Response",
    ),
    "`ServerConnection`": ("ServerConnection",),
    "`ClientConnection`": ("ClientConnection",),
}


@cache
def sections() -> tuple[Section, ...]:
    found: list[Section] = []
    marks = list(_HEADING.finditer(DOC))
    parent: tuple[str, ...] = ()
    for mark, following in zip(marks, [*marks[1:], None], strict=True):
        body = DOC[mark.end() : following.start() if following else len(DOC)]
        title = mark.group(2).strip()
        level = len(mark.group(1))
        own = next((c for start, c in _SECTION_CLASSES.items() if title.startswith(start)), None)
        if level == 2:
            parent = own or ()
        code = [(lang, text) for lang, text in _FENCE.findall(body)]
        found.append(
            Section(title, level, _FENCE.sub("", body), code, own if own is not None else parent)
        )
    return tuple(found)


def section(start: str) -> Section:
    matches = [s for s in sections() if s.title.startswith(start)]
    assert len(matches) == 1, f"core-api.md has no single section titled {start!r}…"
    return matches[0]


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets and quotes."""
    parts: list[str] = []
    current: list[str] = []
    depth, quote = 0, ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def signature_params(args: str) -> list[str] | None:
    """The parameter names of a documented signature, or None when it is a
    call with expressions rather than a signature."""
    names = []
    for part in _split_top(args):
        if part in ("*", "/", "...", "…") or part.startswith("**"):
            continue
        name = re.split(r"[:=]", part, maxsplit=1)[0].strip().lstrip("*")
        if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            return None
        names.append(name)
    return names


def signatures(sec: Section) -> Iterator[tuple[str, list[str]]]:
    """(callable as written, its parameters) for each signature span and
    each signature at the start of a line of the section's python blocks."""
    candidates = list(sec.spans())
    for lang, body in sec.code:
        if lang == "python":
            candidates += _python_signatures(body)
    for text in candidates:
        match = _SIGNATURE.match(text)
        if match is None:
            continue
        params = signature_params(match.group(2))
        if params is not None:
            yield match.group(1), params + (["**"] if "**" in match.group(2) else [])


def _python_signatures(body: str) -> list[str]:
    """``Name(...)`` and ``def name(...)`` of a python block, joined over lines."""
    found = []
    for match in re.finditer(r"^\s*(?:def\s+)?([A-Za-z_]\w*)\(", body, re.MULTILINE):
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(body)):
            depth += {"(": 1, ")": -1}.get(body[end], 0)
            if depth == 0:
                break
        inner = body[match.end() : end]
        inner = ", ".join(p for p in _split_top(inner) if p not in ("self", "cls"))
        found.append(f"{match.group(1)}({' '.join(inner.split())})")
    return found


# ---------------------------------------------------------------- checks


def _report(missing: list[str], what: str) -> None:
    missing = sorted(set(missing))
    assert missing == [], f"core-api.md {what}:\n  " + "\n  ".join(missing)


def _owner_of(sec: Section, name: str) -> tuple[str, Any] | None:
    """The section's class that has ``name``, as (its name, the attribute)."""
    for cls_name in sec.classes:
        cls = registry().get(cls_name)
        if cls is None:
            continue
        value = member(cls, name)
        if value is not _MISSING:
            return cls_name, value
    return None


def _expected_owner(sec: Section) -> str:
    return sec.classes[0] if sec.classes else "?"


def test_every_public_and_second_tier_name_is_described() -> None:
    below = set().union(*(s.words() for s in sections() if s.title != "Public names"))
    undescribed = [
        f"{name} (listed in Public names, described nowhere below)"
        for name in [*meshnet_proto.__all__, *lowlevel.__all__]
        if name not in below
    ]
    _report(undescribed, "leaves names undescribed")


def test_every_dotted_name_exists() -> None:
    missing = []
    for sec in sections():
        for span in sec.spans():
            match = _DOTTED.match(span)
            if match is None or match.group(0).endswith((".py", ".md")):
                continue
            dotted = match.group(0)
            head = dotted.split(".")[0]
            if head not in registry() and not head.startswith(("meshnet_", "_")):
                continue  # a local of prose (`err.to_dict()`, `resp.body`)
            if resolve(dotted) is _MISSING:
                missing.append(f"{dotted} (section {sec.title})")
                missing += [  # and the first link that is missing, if not the last
                    prefix
                    for cut in range(1, dotted.count(".") + 1)
                    if resolve(prefix := dotted.rsplit(".", cut)[0]) is _MISSING
                ]
    _report(missing, "names what the code lacks")


def _documented_callable(sec: Section, written: str) -> tuple[str, Any] | None:
    """(key, the callable) for a signature as written in a section."""
    name = written.lstrip(".")
    if "." in name:
        head = name.split(".")[0]
        if head not in registry() and not head.startswith(("meshnet_", "_")):
            return None  # a local of prose: `err.to_dict()`, `headers.to_pairs()`
        return name, resolve(name)
    if hasattr(builtins, name) or name in _NOT_THE_CORES:
        return None
    # A method of the section's class first: a bare name written in a class's
    # section (`check_head(...)` under SessionTable) is that class's, even
    # where a module function of the core has the same name.
    owned = None if name[0].isupper() else _owner_of(sec, name)
    if owned is not None:
        return f"{owned[0]}.{name}", owned[1]
    if name[0].isupper() or name in registry():
        value = registry().get(name, _MISSING)
        if value is not _MISSING or name[0].isupper():
            return name, value
    if not sec.classes:
        return None  # a method named in passing, outside any class's section
    return f"{_expected_owner(sec)}.{name}", _MISSING


def _all_signatures() -> dict[str, tuple[Any, set[str], list[str]]]:
    """key → (callable, documented parameters together, where); a signature
    written with ``**`` (``Limits(**fields)``) counts as naming them all."""
    found: dict[str, tuple[Any, set[str], list[str]]] = {}
    for sec in sections():
        for written, params in signatures(sec):
            documented = _documented_callable(sec, written)
            if documented is None:
                continue
            key, value = documented
            if key.startswith("_") and key.split(".")[-1] in registry():
                key = key.split(".")[-1]  # `_errors.error_body` is `error_body`
            _, known, where = found.setdefault(key, (value, set(), []))
            known.update(params)
            where.append(sec.title)
    return found


def _is_subclass_error(value: Any) -> bool:
    return (
        isinstance(value, type)
        and issubclass(value, meshnet_proto.MeshnetError)
        and value is not meshnet_proto.MeshnetError
    )


# Written as calls of something the core does not own: the reader's own
# helpers and callbacks in prose.
_NOT_THE_CORES = frozenset({"drain", "on_forget"})


def test_every_signature_names_what_the_code_takes() -> None:
    missing, wrong = [], []
    for key, (value, documented, where) in _all_signatures().items():
        if value is _MISSING:
            missing.append(f"{key} (section {where[0]})")
            continue
        taken = parameters(value)
        if taken is None:
            continue
        wrong += [f"{key}({p}): the code takes no {p}" for p in sorted(documented - taken - {"**"})]
        if "**" in documented or _is_subclass_error(value):
            continue  # all named at once; an error subclass is MeshnetError's signature
        wrong += [f"{key}({p}): undocumented parameter" for p in sorted(taken - documented)]
    _report(missing, "documents callables the code lacks")
    _report(wrong, "documents signatures that differ from the code")


def test_every_attribute_written_in_a_class_section_exists() -> None:
    missing = []
    for sec in sections():
        if not sec.classes:
            continue
        for span in sec.spans():
            if span.startswith("."):
                match = re.match(r"^\.([a-z_][a-z0-9_]*)", span)
            else:
                match = _FIELD.match(span)  # `name: type`, `name -> type`
            if match is None:
                continue
            name = match.group(1)
            if name in _parameters_of(sec.classes):
                continue  # `now: float`: a parameter, not an attribute
            if _owner_of(sec, name) is None and name not in registry():
                missing.append(f"{_expected_owner(sec)}.{name} (section {sec.title})")
    _report(missing, "names attributes the code lacks")


@cache
def _parameters_of(classes: tuple[str, ...]) -> frozenset[str]:
    """Every parameter the classes' constructors and methods take."""
    found: set[str] = set()
    for cls_name in classes:
        cls = registry().get(cls_name)
        if cls is None:
            continue
        for value in [cls, *(getattr(cls, n) for n in _public(cls))]:
            if callable(value):
                found |= parameters(value) or set()
    return frozenset(found)


def _public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def test_the_connections_and_the_table_are_documented_whole() -> None:
    undocumented = []
    for start, cls_name in (
        ("`ServerConnection`", "ServerConnection"),
        ("`ClientConnection`", "ClientConnection"),
        ("The `SessionTable` contract", "SessionTable"),
        ("The gateway's sessions", "ClientSessionTable"),
        ("The gateway's sessions", "Lease"),
    ):
        words = section(start).words()
        if start == "The `SessionTable` contract":
            words = set().union(
                *(s.words() for s in sections() if s.classes == section(start).classes)
            )
        cls = registry()[cls_name]
        undocumented += [f"{cls_name}.{n}" for n in sorted(_public(cls) - words)]
    _report(undocumented, "leaves public methods or properties undocumented")


def test_every_event_field_is_documented() -> None:
    sec = section("Events and connections")
    words = sec.words()
    undocumented, absent = [], []
    for cls_name in sec.classes:
        cls = registry()[cls_name]
        fields = {f.name for f in dataclasses.fields(cls)}
        if cls_name in ("ActivationHead", "ActivationReceived"):
            fields.add("replay")  # read from the query in the constructor
        for name in sorted(fields):
            if name not in words:
                undocumented.append(f"{cls_name}.{name}")
            elif member(cls, name) is _MISSING:
                absent.append(f"{cls_name}.{name}")
    _report(undocumented, "leaves event fields undocumented")
    _report(absent, "documents event fields the code lacks")


def test_the_headers_block_lists_every_field_and_property() -> None:
    (body,) = [text for lang, text in section("Headers").code if lang == "python"]
    listed = set(re.findall(r"^    ([a-z_]+):", body, re.MULTILINE))
    cls = meshnet_proto.WireHeaders
    fields = {f.name for f in dataclasses.fields(cls)}
    properties = {n for n, v in vars(cls).items() if isinstance(v, property)}
    missing = [
        f"WireHeaders.{n} (not in the block)" for n in sorted((fields | properties) - listed)
    ]
    missing += [f"WireHeaders.{n}" for n in sorted(listed) if member(cls, n) is _MISSING]
    _report(missing, "Headers block differs from WireHeaders")


_UNITS = {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


def _default(text: str) -> Any:
    text = text.strip()
    if text.startswith("None"):
        return None
    number, _, unit = text.partition(" ")
    value = float(number) if "." in number else int(number)
    return value * _UNITS[unit] if unit in _UNITS else value


def test_the_limits_table_is_every_field_with_its_default() -> None:
    rows = re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \|", section("Limits").prose, re.MULTILINE)
    fields = {f.name: f.default for f in dataclasses.fields(meshnet_proto.Limits)}
    documented = dict(rows)
    problems = [f"Limits.{n} (not in the table)" for n in sorted(set(fields) - set(documented))]
    problems += [f"Limits.{n} (no such field)" for n in sorted(set(documented) - set(fields))]
    problems += [
        f"Limits.{n}: documented default {documented[n].strip()}, the code's {fields[n]!r}"
        for n in sorted(set(fields) & set(documented))
        if _default(documented[n]) != fields[n]
    ]
    _report(problems, "Limits table differs from the code")


def test_the_modules_table_is_the_cores_modules() -> None:
    rows = set(re.findall(r"^\| `(_[a-z0-9_]+)\.py` \|", section("Modules").prose, re.MULTILINE))
    modules = {p.stem for p in CORE.glob("_*.py")} - {"__init__"}
    problems = [f"{m}.py (not in the table)" for m in sorted(modules - rows)]
    problems += [f"{m}.py (no such module)" for m in sorted(rows - modules)]
    _report(problems, "modules table differs from src/meshnet_proto")


# The objects the fenced driver loops call methods on.
_LOOP_OBJECTS: dict[str, Callable[[], Any]] = {
    "table": lambda: meshnet_proto.SessionTable,
    "clients": lambda: meshnet_proto.ClientSessionTable,
    "lease": lambda: lowlevel.Lease,
}


def test_the_driver_loops_call_only_what_exists() -> None:
    missing = []
    for sec in sections():
        for _, body in sec.code:
            for obj, attr in re.findall(r"\b(table|clients|lease)\.([a-z_]+)", body):
                cls = _LOOP_OBJECTS[obj]()
                if member(cls, attr) is _MISSING:
                    missing.append(f"{cls.__name__}.{attr} (a loop in section {sec.title})")
    _report(missing, "driver loops call what the code lacks")


def test_the_checks_see_the_document() -> None:
    # The parsing above finds what it checks (a regex that matched nothing
    # would pass every test).
    assert len(sections()) > 20
    sigs = _all_signatures()
    for key in (
        "ServerConnection",
        "SessionTable.offer",
        "ActivationHead",
        "ClientSessionTable.begin",
    ):
        assert key in sigs, key
    assert "check_head" in section("The `SessionTable` contract").words()
