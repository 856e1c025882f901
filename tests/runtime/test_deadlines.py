"""meshnet_runtime.deadlines: the loop clock a connection looks up once."""

from __future__ import annotations

import anyio
import pytest

from meshnet_runtime.deadlines import Deadline, loop_clock

pytestmark = pytest.mark.anyio


async def test_the_loop_clock_is_the_clock_anyio_reads() -> None:
    # Each backend has its own clock (trio's is offset from the OS's): the
    # function looked up once must read the one deadlines are set on.
    clock = loop_clock()
    before = anyio.current_time()
    now = clock()
    after = anyio.current_time()
    assert before <= now <= after
    await anyio.sleep(0.01)  # stall under test: the time the clock must see pass
    assert clock() >= now + 0.01


async def test_a_deadline_measured_by_it_expires_as_anyio_says() -> None:
    clock = loop_clock()
    deadline = Deadline.after(0.05)
    assert deadline.at - clock() > 0
    await anyio.sleep(0.06)  # stall under test: past the deadline
    assert deadline.at - clock() <= 0 and deadline.expired
