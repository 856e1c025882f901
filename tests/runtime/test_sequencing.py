"""``meshnet_runtime.sequencing.SequencedTable``: the waiting around a
``SessionTable`` (wire-2 §3), through its public API, on trio and asyncio
(the ``anyio_backend`` fixture below runs each test on both).

Tasks meet on events, not on time: ``wait_all_tasks_blocked`` returns once
every other task has run to its wait. On trio a ``MockClock`` with
``autojump_threshold=0`` passes the reorder timeouts and deadlines in no
real time (once every task is blocked, it jumps to the next deadline); the
TTL is measured on a clock the test holds (the table takes ``clock=``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
from trio.testing import MockClock

from meshnet_proto import (
    Join,
    Limits,
    MeshnetError,
    Process,
    Reforward,
    Replay,
    SequencingError,
    SessionTable,
    WireHeaders,
)
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.sequencing import SequencedTable, gone

pytestmark = pytest.mark.anyio

S = "5b1e0c2a-2222-4abc-8def-000000000001"
OTHER = "5b1e0c2a-2222-4abc-8def-000000000002"
TOKENS = 4
TIMEOUT = 0.3  # the reorder timeout: on trio's mock clock, no real time at all


@pytest.fixture(params=["trio-mock", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    """Trio with a fresh mock clock for each test, and asyncio's real one."""
    if request.param == "trio-mock":
        return ("trio", {"clock": MockClock(autojump_threshold=0)})
    return "asyncio"


def hdr(index: int, total: int = 4, *, session: str = S) -> WireHeaders:
    return WireHeaders(
        shape=(1, TOKENS, 8),
        dtype="float32",
        session=session,
        chunk_index=index,
        chunk_total=total,
        position=TOKENS * index,
    )


def tag(index: int, session: str = S) -> bytes:
    return f"{session}:{index}".encode().ljust(16, b".")[:16]


def make(
    clock: Callable[[], float] = anyio.current_time, **limits: Any
) -> tuple[SequencedTable[str], list[str]]:
    timeouts: list[str] = []
    table = SessionTable(Limits(**{"reorder_timeout": TIMEOUT, **limits}))
    seq = SequencedTable(table, on_wait_timeout=lambda: timeouts.append("t"), clock=clock)
    return seq, timeouts


async def admit(seq: SequencedTable[str], index: int, seconds: float = 10.0, **kw: Any) -> Any:
    return await seq.admit(hdr(index, **kw), tag(index, **kw), Deadline.after(seconds))


async def forever() -> str:
    """A run that never answers (until cancelled)."""
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


async def until_waiting(seq: SequencedTable[str], sessions: int = 1) -> None:
    await anyio.wait_all_tasks_blocked()  # every task has run to its wait
    assert seq.sessions_with_waiters == sessions


async def test_an_in_order_chunk_is_processed_at_once() -> None:
    seq, timeouts = make()
    decision = await admit(seq, 0)
    assert isinstance(decision, Process) and decision.ticket.index == 0
    assert seq.sessions_with_waiters == 0 and timeouts == []


async def test_a_chunk_ahead_waits_until_its_predecessor_left_the_stage() -> None:
    seq, _ = make()
    first = await admit(seq, 0)
    got: list[Any] = []

    async def second() -> None:
        got.append(await admit(seq, 1))

    async with anyio.create_task_group() as tg:
        tg.start_soon(second)
        await until_waiting(seq)
        assert got == []
        seq.stage_done(first.ticket, "out")  # wakes chunk 1
    assert isinstance(got[0], Process) and got[0].ticket.index == 1
    assert seq.sessions_with_waiters == 0  # the wake-up event went with the wake


async def test_a_wait_past_the_reorder_timeout_is_the_tables_error_and_counted() -> None:
    seq, timeouts = make()
    await admit(seq, 0, session=OTHER)  # the table knows some session
    first = await admit(seq, 0)
    seq.stage_done(first.ticket, "out")
    seq.table.response_ready(first.ticket, "reply", anyio.current_time())
    # Chunk 1 never comes: chunk 2 times out waiting for it.
    with anyio.fail_after(5), pytest.raises(SequencingError) as raised:
        await admit(seq, 2)
    assert raised.value.code == "chunk_wait_timeout"
    assert timeouts == ["t"]
    assert seq.sessions_with_waiters == 0  # not left behind


async def test_cancelled_while_waiting_the_tables_place_is_given_up() -> None:
    # Room for one waiter: a cancelled one must not keep it.
    seq = SequencedTable[str](SessionTable(Limits(reorder_timeout=TIMEOUT), max_pending_waiters=1))
    first = await admit(seq, 0)
    with anyio.move_on_after(0.05):
        await admit(seq, 2)
    # Had the place been kept, a second waiter would be refused (503).
    got: list[Any] = []

    async def third() -> None:
        got.append(await admit(seq, 1))

    async with anyio.create_task_group() as tg:
        tg.start_soon(third)
        await until_waiting(seq)  # the place the cancelled waiter gave up
        assert got == []
        seq.stage_done(first.ticket, "out")
    assert isinstance(got[0], Process) and got[0].ticket.index == 1


async def test_a_retransmission_of_a_running_chunk_joins_its_answer() -> None:
    seq, _ = make()
    first = await admit(seq, 0)
    assert isinstance(first, Process)
    release = anyio.Event()
    joined: list[str] = []

    async def work() -> str:
        await release.wait()
        return "reply"

    async def retransmission() -> None:
        decision = await admit(seq, 0)
        assert isinstance(decision, Join) and decision.ticket == first.ticket
        joined.append(await seq.join(decision.ticket, Deadline.after(5)))

    async with anyio.create_task_group() as tg:
        # The run goes at once after its admit (the node: no await between):
        # a Join finds its outcome.
        tg.start_soon(seq.run, first.ticket, work)
        await anyio.wait_all_tasks_blocked()  # the run waits for its release
        tg.start_soon(retransmission)
        await anyio.wait_all_tasks_blocked()  # the join waits for the run
        assert joined == []
        release.set()
    assert joined == ["reply"]


async def test_a_joined_retransmission_gets_the_runs_error() -> None:
    seq, _ = make()
    first = await admit(seq, 0)
    release, joining = anyio.Event(), anyio.Event()

    async def fails() -> str:
        await release.wait()
        raise SequencingError("the stage refused", code="kv_cache_mismatch")

    errors: list[MeshnetError] = []

    async def joiner() -> None:
        joining.set()  # then join runs to its wait without yielding
        await _join_into(seq, first.ticket, errors)

    async def runs() -> None:
        with pytest.raises(SequencingError):
            await seq.run(first.ticket, fails)

    async with anyio.create_task_group() as tg:
        tg.start_soon(runs)
        await anyio.wait_all_tasks_blocked()  # the run waits for its release
        tg.start_soon(joiner)
        await joining.wait()
        release.set()
    assert [e.code for e in errors] == ["kv_cache_mismatch"]


async def _join_into(seq: SequencedTable[str], ticket: Any, errors: list[MeshnetError]) -> None:
    try:
        await seq.join(ticket, Deadline.after(5))
    except MeshnetError as exc:
        errors.append(exc)


async def test_a_cancelled_run_tells_its_joiners_gone() -> None:
    seq, _ = make()
    first = await admit(seq, 0)
    errors: list[MeshnetError] = []
    async with anyio.create_task_group() as tg:
        run = anyio.CancelScope()

        async def runs() -> None:
            with run:
                await seq.run(first.ticket, forever)

        tg.start_soon(runs)
        await anyio.wait_all_tasks_blocked()  # the run is under way
        tg.start_soon(_join_into, seq, first.ticket, errors)
        await anyio.wait_all_tasks_blocked()  # and joined
        assert errors == []
        run.cancel()
    assert [e.message for e in errors] == [gone().message]


async def test_a_join_ends_at_its_deadline() -> None:
    seq, _ = make()
    first = await admit(seq, 0)
    errors: list[MeshnetError] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(seq.run, first.ticket, forever)
        await anyio.wait_all_tasks_blocked()  # the run is under way
        try:
            await seq.join(first.ticket, Deadline.after(0.05))
        except MeshnetError as exc:
            errors.append(exc)
        tg.cancel_scope.cancel()
    assert [e.status for e in errors] == [504]


async def test_replay_and_reforward_are_handed_back() -> None:
    seq, _ = make()
    first = await admit(seq, 0)
    seq.stage_done(first.ticket, "output")
    # Answered already: the stored answer.
    seq.table.response_ready(first.ticket, "reply", anyio.current_time())
    replayed = await admit(seq, 0)
    assert isinstance(replayed, Replay) and replayed.response == "reply"
    # The stage ran but the forward failed: the stored output goes again.
    other = await admit(seq, 0, session=OTHER)
    seq.stage_done(other.ticket, "kept")
    seq.table.forward_failed(other.ticket, anyio.current_time())
    again = await admit(seq, 0, session=OTHER)
    assert isinstance(again, Reforward) and again.stage_output == "kept"


async def test_ending_a_session_wakes_its_waiters() -> None:
    seq, timeouts = make()
    first = await admit(seq, 0)
    seq.stage_failed(first.ticket)  # chunk 0 may come again; chunk 1 waits
    errors: list[MeshnetError] = []

    async def waiter() -> None:
        try:
            await admit(seq, 1)
        except MeshnetError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await until_waiting(seq)
        assert seq.end_session(S) is True
    assert [e.code for e in errors] == ["session_unknown"]
    assert seq.sessions_with_waiters == 0 and timeouts == []
    assert S not in seq.table and seq.end_session(S) is False


async def test_expire_forgets_idle_sessions() -> None:
    now = [1000.0]  # the table's clock, moved by the test
    seq, _ = make(clock=lambda: now[0], session_ttl=0.05)
    first = await admit(seq, 0)
    seq.stage_done(first.ticket, "out")
    seq.table.response_ready(first.ticket, "reply", now[0])
    now[0] += 0.05
    assert seq.expire() == []  # idle for exactly the TTL: kept
    now[0] += 0.01
    assert seq.expire() == [S] and S not in seq.table
