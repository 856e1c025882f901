"""meshnet_proto's public API: a small, explicit, typed set of names.

`__all__` is written out (no star re-exports of the private modules), stays
small, every name in it exists, docs/core-api.md lists exactly it, and the
package ships its PEP 561 marker.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from types import ModuleType

import meshnet_proto
from meshnet_proto import lowlevel

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(meshnet_proto.__file__).parent


def test_the_public_api_is_small_and_every_name_exists() -> None:
    names = meshnet_proto.__all__
    assert len(names) <= 35
    assert len(set(names)) == len(names)
    assert [name for name in names if not hasattr(meshnet_proto, name)] == []
    assert [name for name in names if name.startswith("_")] == []


def test_a_star_import_gives_exactly_the_public_names() -> None:
    namespace: dict[str, object] = {}
    exec("from meshnet_proto import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(meshnet_proto.__all__)


def test_internals_are_not_public() -> None:
    for name in ("parse_canonical_uint", "AUTO_MIN_BYTES", "Waiter", "Reservation", "Ticket"):
        assert name not in meshnet_proto.__all__
    assert isinstance(meshnet_proto.__version__, str)
    assert meshnet_proto.WIRE_VERSION == 2


def test_each_public_name_comes_from_the_core() -> None:
    for name in meshnet_proto.__all__:
        module = getattr(getattr(meshnet_proto, name), "__module__", "meshnet_proto")
        assert module.startswith("meshnet_proto"), (name, module)


def _tables() -> list[list[str]]:
    """The names of each table in core-api.md's "Public names" section."""
    text = (ROOT / "docs" / "core-api.md").read_text(encoding="utf-8")
    section = text.split("\n## Public names\n", 1)[1].split("\n## ", 1)[0]
    tables = []
    for table in re.findall(r"(?:^\|.*\|\n)+", section, flags=re.MULTILINE):
        rows = table.splitlines()[2:]  # past the head and its rule
        tables.append(
            [n for row in rows for n in re.findall(r"`([A-Za-z_0-9]+)`", row.split("|")[2])]
        )
    return tables


def test_core_api_md_lists_exactly_the_public_names() -> None:
    top, second = _tables()
    for listed in (top, second):
        assert len(listed) == len(set(listed)), "a name listed twice"
    assert sorted(top) == sorted(meshnet_proto.__all__)
    assert sorted(second) == sorted(lowlevel.__all__)
    text = (ROOT / "docs" / "core-api.md").read_text(encoding="utf-8")
    assert f"The public API is the {len(meshnet_proto.__all__)} names" in text


def test_the_second_tier_is_apart_from_the_top_level() -> None:
    names = lowlevel.__all__
    assert len(set(names)) == len(names)
    assert [name for name in names if not hasattr(lowlevel, name)] == []
    assert set(names).isdisjoint(meshnet_proto.__all__)
    extra = sorted(n for n in vars(lowlevel) if not n.startswith("_") and n not in names)
    assert extra == []


def test_the_package_namespace_holds_nothing_public_but_the_api() -> None:
    # No star re-export: the private modules' other names stay in them.
    extra = sorted(
        name
        for name, value in vars(meshnet_proto).items()
        if not name.startswith("_")
        and name not in meshnet_proto.__all__
        and not isinstance(value, ModuleType)  # meshnet_proto.lowlevel, once imported
    )
    assert extra == []


def test_the_package_ships_its_type_marker() -> None:
    marker = PACKAGE / "py.typed"
    assert marker.is_file() and marker.read_bytes() == b""
    # setuptools copies it into the wheel only when package-data names it.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["meshnet_proto"]
