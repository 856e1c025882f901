"""Waiting for a condition, the one sanctioned way a test polls.

Tests synchronise on events: ``anyio.wait_all_tasks_blocked``, an Event the
code under test sets, ``trio.testing.Sequencer``, a ``MockClock`` for
timeouts. Where no event exists (another process, a probe loop's view of
a peer, a socket's close seen by a pool) a test waits until an observable
condition holds: these helpers poll it, and their bound ends a test that
would otherwise hang; it is never a timing claim. A bare ``sleep(`` anywhere
else in tests/ fails tests/repo/test_no_sleep_sync.py unless its line says
``# stall under test`` (the sleep is the behaviour being tested).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from meshnet_proto import Wait

BOUND = 60.0  # seconds: only ends a hang


async def wait_until(
    condition: Callable[[], bool | Awaitable[bool]],
    what: str = "the condition",
    *,
    timeout: float = BOUND,
    every: float = 0.005,
) -> None:
    """Until ``condition()`` (a plain or an async predicate) holds; a
    TimeoutError naming ``what`` after ``timeout`` seconds."""
    with anyio.move_on_after(timeout):
        while True:
            held = condition()
            if inspect.isawaitable(held):
                held = await held
            if held:
                return
            await anyio.sleep(every)
    raise TimeoutError(f"{what}: not within {timeout} s")


def wait_until_sync(
    condition: Callable[[], bool],
    what: str = "the condition",
    *,
    timeout: float = BOUND,
    every: float = 0.05,
) -> None:
    """``wait_until`` for a test without an event loop (subprocesses)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(every)


def holds_within(
    condition: Callable[[], bool], *, timeout: float = BOUND, every: float = 0.05
) -> bool:
    """Whether ``condition()`` comes to hold within ``timeout`` seconds (for
    tests that assert on the answer themselves)."""
    try:
        wait_until_sync(condition, timeout=timeout, every=every)
    except TimeoutError:
        return False
    return True


class Waits:
    """The chunks a ``SequencedTable`` told to wait (their first offer's
    ``Wait``), counted as it decides: "chunks 3, 2, 1 are waiting" is then
    ``wait_until(lambda: waits.count == 3)``, not a sleep."""

    def __init__(self, seq: Any) -> None:
        self.count = 0
        offer = seq.offer

        def counted(*args: Any, **kwargs: Any) -> Any:
            decision = offer(*args, **kwargs)
            if isinstance(decision, Wait) and kwargs.get("after") is None:
                self.count += 1
            return decision

        seq.offer = counted  # the instance's own: the table is the test's
