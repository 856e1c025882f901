"""A memory cgroup of our own for a test's child process (created, then removed).

This machine and CI run as root with cgroup v1's memory controller at
/sys/fs/cgroup/memory; cgroup v2 (``memory.max``) is used where v1 is absent.
A test that cannot make one fails with the reason (never skips).
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

_HIERARCHIES = ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
                (Path("/sys/fs/cgroup"), "memory.max"))  # fmt: skip


def _join(procs: Path) -> None:
    """In the child, before exec: it starts inside the cgroup."""
    procs.write_text(str(os.getpid()))


@contextmanager
def memory_cgroup(limit: int) -> Iterator[tuple[Path, str, Callable[[], None]]]:
    """``(directory, name, join)``: ``join`` is a ``preexec_fn`` that moves the child
    into the cgroup before it execs. The cgroup is removed after the block (its
    processes must have ended)."""
    name = f"meshnet-test-{uuid.uuid4().hex[:12]}"
    errors = []
    for root, limit_file in _HIERARCHIES:
        if limit_file == "memory.max" and not (root / "cgroup.controllers").exists():
            errors.append(f"{root}: no cgroup v2 hierarchy")
            continue
        path = root / name
        try:
            path.mkdir()
        except OSError as exc:
            errors.append(f"{root}: {exc}")
            continue
        try:
            (path / limit_file).write_text(str(limit))
        except OSError as exc:
            path.rmdir()
            errors.append(f"{path / limit_file}: {exc}")
            continue
        try:
            yield path, name, functools.partial(_join, path / "cgroup.procs")
        finally:
            path.rmdir()
        return
    pytest.fail(
        "cannot create a memory cgroup (needs root and cgroup v1 or v2): " + "; ".join(errors)
    )
