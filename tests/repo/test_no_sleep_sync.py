"""No test synchronises by sleeping (issue 42).

A sleep used to wait for something to happen passes on an idle machine and
fails beside two CPU hogs. Tests wait on events instead (an Event, a
Sequencer, ``wait_all_tasks_blocked``, a ``MockClock``), or, where no event
exists, on an observable condition through tests/support/waiting.py. A
sleep that is itself the behaviour under test (a slow handler, a client that
stalls) says so on its line with the marker below.
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SLEEP = re.compile(r"\bsleep\(")
MARKER = "# stall under test"
# The polling helpers: their sleep is the interval between two looks at a
# condition, bounded by a timeout.
HELPERS = {"support/waiting.py"}


def unmarked_sleeps() -> list[str]:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        name = path.relative_to(TESTS).as_posix()
        if name in HELPERS or path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if SLEEP.search(line) and MARKER not in line:
                found.append(f"tests/{name}:{number}: {line.strip()}")
    return found


def test_no_sleep_is_used_as_synchronisation() -> None:
    assert unmarked_sleeps() == [], (
        "wait on an event or on support.waiting.wait_until, or mark a sleep "
        f"that is the behaviour under test with {MARKER!r}"
    )


def test_the_scan_sees_a_sleep() -> None:
    # The pattern itself: were it wrong, the test above would pass on anything.
    assert SLEEP.search("        await anyio.sleep(0.05)")
    assert SLEEP.search("time.sleep(0.1)")
    assert not SLEEP.search("await anyio.sleep_forever()")


def test_the_helpers_are_the_ones_that_poll() -> None:
    for name in HELPERS:
        assert SLEEP.search((TESTS / name).read_text()), name
