"""How much memory this process may use: the cgroup's limit and the machine's free memory.

``memory_limit()`` is the smallest of:

* the cgroup limit of this process and of every cgroup above it (a parent's
  limit binds its children too): cgroup v2 ``memory.max`` (``max`` is
  unlimited) under the ``0::/path`` line of ``/proc/self/cgroup``, cgroup v1
  ``memory.limit_in_bytes`` (values from 2**62 up are "unlimited") under the
  line of the ``memory`` controller;
* what is left in such a cgroup: its limit minus its usage (less the
  inactive file cache the kernel drops before it fails an allocation),
  where the usage is readable;
* ``MemAvailable`` of ``/proc/meminfo``.

The two "what is left" figures are read while this process already runs, so
its own resident memory (``VmRSS``) is added back to them: a footprint counts
the process's baseline itself (``footprint.RUNTIME_BYTES``).

The roots are parameters so that tests read fake trees. Nothing readable
gives ``MemoryLimit(None, "unknown")``: no check. ``parse_bytes`` reads the
``--memory-limit``/``--kv-budget-bytes`` values (``4GiB``, ``512MiB``, ``1GB``).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MemoryLimit", "limit_from_flag", "memory_limit", "parse_bytes", "parse_bytes_or_auto"]

UNLIMITED_V1 = 2**62  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)")


@dataclass(frozen=True, slots=True)
class MemoryLimit:
    bytes: int | None  # None: nothing readable, no limit known
    source: str  # e.g. "cgroup memory.limit_in_bytes", "MemAvailable", "--memory-limit"


def parse_bytes(text: str) -> int:
    """``"4GiB"`` → 4294967296; a plain integer is bytes. Positive only."""
    found = _SIZE.fullmatch(text.strip()) if text.isascii() else None
    unit = _UNITS.get(found.group(2).lower()) if found else None
    if found is None or unit is None:
        raise argparse.ArgumentTypeError(
            f"expected bytes such as 1073741824, 512MiB, 4GiB or 1GB, got {text!r}"
        )
    number = found.group(1)
    value = int(number) * unit if "." not in number else int(float(number) * unit)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of bytes, got {text!r}")
    return value


def parse_bytes_or_auto(text: str) -> int | str:
    return "auto" if text == "auto" else parse_bytes(text)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _kib_field(path: Path, key: str) -> int | None:
    """``Key:   123 kB`` of /proc/meminfo or /proc/self/status, in bytes."""
    try:
        for line in path.read_text().splitlines():
            name, _, rest = line.partition(":")
            if name == key:
                return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_paths(proc_root: Path) -> tuple[str | None, str | None]:
    """(v2 path, v1 memory path) of this process, from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _levels(root: Path, path: str) -> list[Path]:
    """The cgroup's directory and every one above it, up to ``root`` itself."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    return [root.joinpath(*parts[:k]) for k in range(len(parts), -1, -1)]


def _walk(
    root: Path,
    path: str,
    *,
    limit_file: str,
    usage_file: str,
    inactive_key: str,
    label: str,
    unlimited: int | None,
) -> list[tuple[int, str]]:
    found = []
    for level in _levels(root, path):
        limit = _read_int(level / limit_file)
        if limit is None or (unlimited is not None and limit >= unlimited):
            continue
        where = "/" + str(level.relative_to(root)).lstrip(".")
        found.append((limit, f"cgroup {limit_file} of {where}"))
        usage = _read_int(level / usage_file)
        if usage is not None:
            usage -= _stat_value(level / "memory.stat", inactive_key)
            found.append((limit - max(usage, 0), f"cgroup {label} {limit_file} - usage of {where}"))
    return found


def memory_limit(
    proc_root: str | Path = "/proc", sys_root: str | Path = "/sys/fs/cgroup"
) -> MemoryLimit:
    """The memory this process may use, and where the figure comes from (module doc)."""
    proc, cgroups = Path(proc_root), Path(sys_root)
    v2, v1 = _cgroup_paths(proc)
    hard: list[tuple[int, str]] = []  # limits and what is left under them
    if v2 is not None:
        # A v2-only host mounts the hierarchy at the root; a hybrid one at unified/.
        mount = cgroups if (cgroups / "cgroup.controllers").exists() else cgroups / "unified"
        hard += _walk(
            mount,
            v2,
            limit_file="memory.max",
            usage_file="memory.current",
            inactive_key="inactive_file",
            label="v2",
            unlimited=None,
        )
    if v1 is not None:
        hard += _walk(
            cgroups / "memory",
            v1,
            limit_file="memory.limit_in_bytes",
            usage_file="memory.usage_in_bytes",
            inactive_key="total_inactive_file",
            label="v1",
            unlimited=UNLIMITED_V1,
        )
    own = _kib_field(proc / "self" / "status", "VmRSS") or 0
    candidates: list[tuple[int, str]] = []
    for value, source in hard:
        # "limit - usage" is read with this process inside: add back what it holds.
        candidates.append((value + own, source) if "usage" in source else (value, source))
    available = _kib_field(proc / "meminfo", "MemAvailable")
    if available is not None:
        candidates.append((available + own, "MemAvailable of /proc/meminfo"))
    if not candidates:
        return MemoryLimit(None, "unknown")
    value, source = min(candidates, key=lambda c: c[0])
    return MemoryLimit(max(value, 0), source)


def limit_from_flag(value: int | str | None) -> MemoryLimit:
    """``--memory-limit``: a number of bytes as given, ``auto`` (or none) read
    from the machine (``memory_limit``) — for the node and ``meshnet run`` alike."""
    if isinstance(value, int):
        return MemoryLimit(value, "--memory-limit")
    return memory_limit()
