"""What the two server-surface harnesses share: the bounded loop, the saved
crash, and atheris' one-loop-per-session portal.

A harness supplies a *target*: an async context manager that starts the
servers it fuzzes and yields an object with ``run_input(data)`` (one input;
raises ``InvariantBroken`` on a finding), ``check_alive()`` (the servers
still answer correctly) and ``inputs`` (how many ran).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Callable, Iterable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Protocol, TypeVar

import anyio
import anyio.abc
import anyio.from_thread

__all__ = ["FuzzTarget", "add_bounded_arguments", "atheris_main", "run_bounded", "save_crash"]


class FuzzTarget(Protocol):
    inputs: int

    async def run_input(self, data: bytes) -> None: ...

    async def check_alive(self) -> None: ...


Target = TypeVar("Target", bound=FuzzTarget)


async def run_bounded(
    open_target: Callable[[], AbstractAsyncContextManager[Target]],
    inputs: Iterable[bytes],
    *,
    crash_prefix: str,
    broken: type[Exception],
    alive_every: int = 50,
) -> Target:
    """Run ``inputs`` against one target; on a finding save the input and re-raise."""
    async with open_target() as target:
        for data in inputs:
            try:
                await target.run_input(data)
                if target.inputs % alive_every == 0:
                    await target.check_alive()
            except broken:
                save_crash(crash_prefix, data)
                raise
        await target.check_alive()
        return target


def add_bounded_arguments(parser: argparse.ArgumentParser) -> None:
    """The bounded mode's flags, the same for every harness."""
    parser.add_argument("--seconds", type=float, help="stop after this long")
    parser.add_argument("--runs", type=int, help="stop after this many inputs")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--backend", choices=("trio", "asyncio"), default="trio")


def save_crash(prefix: str, data: bytes) -> Path:
    path = Path(f"crash-{prefix}-{hashlib.sha256(data).hexdigest()[:16]}.bin")
    path.write_bytes(data)
    print(f"invariant broken; input saved to {path}", file=sys.stderr)
    return path


def atheris_main(  # pragma: no cover - needs atheris
    argv: list[str], open_target: Callable[[], AbstractAsyncContextManager[FuzzTarget]]
) -> None:
    """One event loop in a thread for the whole session; each input is a call into it."""
    import atheris

    async def hold(*, task_status: anyio.abc.TaskStatus[FuzzTarget]) -> None:
        # The servers live in one task of the portal's loop for the whole
        # session (their task groups cannot span separate portal calls).
        async with open_target() as target:
            task_status.started(target)
            await anyio.sleep_forever()

    with anyio.from_thread.start_blocking_portal("trio") as portal:
        _, target = portal.start_task(hold)

        def test_one_input(data: bytes) -> None:
            portal.call(target.run_input, data)
            if target.inputs % 200 == 0:
                portal.call(target.check_alive)

        atheris.Setup(argv, test_one_input)
        atheris.Fuzz()
