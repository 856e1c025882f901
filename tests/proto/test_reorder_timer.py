"""The reorder timeout counts only time without progress (wire-2 §3.3, issue 19).

A chunk that arrives before its predecessor waits; the reorder timeout is
there to find a predecessor lost on its way. One that arrived and sits in
the stage (computing, or queued behind other sessions' work) is not lost,
so the timer does not run then, and starts afresh when a chunk of the
session leaves the stage. The core's rules first, through the public API
with a hand-moved clock; then two properties over a simulated node that
computes one chunk at a time. A real node on loopback:
tests/runtime/test_reorder_under_compute.py (this folder is the pure core's).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_proto import (
    Limits,
    Process,
    SequencingError,
    SessionTable,
    Wait,
    WireHeaders,
)
from meshnet_proto._sequencer import Ticket
from meshnet_proto._waiters import Waiter

T = 1.0  # the reorder timeout of the core tests
TTL = 100.0
S = "5b1e0c2a-1111-4abc-8def-000000000001"
TOKENS = 4


def hdr(index: int, total: int = 4, *, session: str = S, position: int | None = -1) -> WireHeaders:
    return WireHeaders(
        shape=(1, TOKENS, 8),
        dtype="float32",
        session=session,
        chunk_index=index,
        chunk_total=total,
        position=TOKENS * index if position == -1 else position,
    )


class Node:
    """A synchronous driver of the table with a hand-moved clock."""

    def __init__(self, **limits: Any) -> None:
        self.table = SessionTable(Limits(**{"reorder_timeout": T, "session_ttl": TTL, **limits}))
        self.now = 0.0

    def offer(
        self,
        index: int,
        total: int = 4,
        *,
        waiter: Waiter | None = None,
        deadline: float | None = None,
        session: str = S,
        position: int | None = -1,
    ) -> Any:
        h = hdr(index, total, session=session, position=position)
        tag = f"{session}:{index}:{position}".encode().ljust(16, b".")[:16]
        return self.table.offer(h, tag, self.now, waiter=waiter, deadline=deadline)

    def admit(self, index: int, total: int = 4, **kw: Any) -> Ticket:
        decision = self.offer(index, total, **kw)
        assert isinstance(decision, Process), decision
        return decision.ticket

    def wait(self, index: int, total: int = 4, **kw: Any) -> Wait:
        decision = self.offer(index, total, **kw)
        assert isinstance(decision, Wait), decision
        return decision

    def done(self, ticket: Ticket) -> None:
        self.table.stage_done(ticket, "out", self.now)
        self.table.response_ready(ticket, "resp", self.now)

    def times_out(self, w: Wait, total: int = 4, **kw: Any) -> SequencingError:
        with pytest.raises(SequencingError) as raised:
            self.offer(w.waiter.index, total, waiter=w.waiter, session=w.waiter.session, **kw)
        return raised.value


# ------------------------------------------------------------------ the core's rules


def test_a_predecessor_in_the_stage_longer_than_the_timeout_does_not_time_the_waiter_out() -> None:
    node = Node()
    t0 = node.admit(0)  # in the stage (say, queued behind other sessions)
    w = node.wait(1)
    assert w.until == TTL  # the timer does not run: only the wait's end bounds it
    node.now = 50 * T  # woken for nothing, or by another waiter's timeout
    again = node.wait(1, waiter=w.waiter)
    assert again == w  # the same until: a pure function of the table
    node.done(t0)
    assert isinstance(node.offer(1, waiter=again.waiter), Process)


def test_a_predecessor_admitted_after_the_wait_began_stops_the_timer_at_until() -> None:
    """The driver is not woken by an admission: offered again at until, the
    waiter sees its predecessor in the stage and keeps waiting."""
    node = Node()
    w = node.wait(1)  # a chunk of a session not started yet
    assert w.until == T
    node.now = 0.5 * T
    t0 = node.admit(0)
    node.now = T
    paused = node.wait(1, waiter=w.waiter)
    assert paused.until == TTL and paused.waiter.serial == w.waiter.serial
    node.now = 30 * T
    node.done(t0)
    assert isinstance(node.offer(1, waiter=paused.waiter), Process)


def test_after_progress_the_timer_restarts() -> None:
    node = Node()
    node.done(node.admit(0))
    w3 = node.wait(3)  # waits for 1 and 2
    assert w3.until == T
    node.now = 0.9 * T
    t1 = node.admit(1)
    node.now = 5 * T
    node.done(t1)  # progress: a fresh timeout from now for chunk 2 to arrive
    w3 = node.wait(3, waiter=w3.waiter)
    assert w3.until == 6 * T
    node.now = 5.9 * T
    assert node.wait(3, waiter=w3.waiter).until == 6 * T
    node.now = 6 * T
    err = node.times_out(w3)
    assert (err.status, err.code, err.header) == (
        409,
        "chunk_wait_timeout",
        "x-meshnet-chunk-index",
    )
    assert (
        err.message == f"session {S}: chunk 3 waited 6 s for chunk 2, the last 1 s without progress"
    )


def test_a_predecessor_that_never_arrives_times_out_after_the_reorder_timeout() -> None:
    node = Node()
    node.done(node.admit(0))
    w = node.wait(2)
    node.now = 0.5 * T
    w = node.wait(2, waiter=w.waiter)
    assert w.until == T
    node.now = T
    assert node.times_out(w).code == "chunk_wait_timeout"
    # The wait is over: its place is free, and the session did not move.
    assert node.table.position(S) == TOKENS
    assert node.table.give_up(w.waiter, node.now).code == "session_unknown"


def test_a_session_that_never_starts_times_out_with_session_unknown() -> None:
    node = Node()
    w = node.wait(1)
    node.now = T
    err = node.times_out(w)
    assert (err.code, err.header) == ("session_unknown", "x-meshnet-session")
    assert "never started" in err.message and "1 s" in err.message


def test_a_failed_predecessor_restarts_the_timer_for_its_retransmission() -> None:
    node = Node()
    t0 = node.admit(0)
    w = node.wait(1)
    node.now = 20 * T
    node.table.stage_failed(t0, node.now)  # not progress, but no stall either
    w = node.wait(1, waiter=w.waiter)
    assert w.until == 21 * T
    node.now = 20.5 * T  # the sender retransmits chunk 0 in time
    t0 = node.admit(0)
    node.now = 40 * T
    assert node.wait(1, waiter=w.waiter).until == TTL
    node.done(t0)
    assert isinstance(node.offer(1, waiter=w.waiter), Process)


def test_a_failed_predecessor_not_sent_again_times_the_waiter_out() -> None:
    node = Node()
    t0 = node.admit(0)
    w = node.wait(1)
    node.now = 3 * T
    node.table.stage_failed(t0, node.now)
    w = node.wait(1, waiter=w.waiter)
    node.now = 4 * T
    err = node.times_out(w)
    assert (
        err.message == f"session {S}: chunk 1 waited 4 s for chunk 0, the last 1 s without progress"
    )


def test_the_deadline_bounds_every_wait() -> None:
    node = Node()
    t0 = node.admit(0)
    w = node.wait(1, deadline=5 * T)
    assert w.until == 5 * T and w.waiter.end == 5 * T
    node.now = 5 * T  # the predecessor still computes: the deadline ends the wait
    err = node.times_out(w)
    assert err.code == "chunk_wait_timeout"
    assert err.message == f"session {S}: chunk 1 waited 5 s for chunk 0, until its deadline"
    node.done(t0)
    # A deadline before the reorder timeout ends a stalled wait too; a later
    # offer's deadline does not move it (the first Wait fixed it).
    w = node.wait(2, deadline=node.now + 0.25 * T)
    assert w.until == node.now + 0.25 * T
    assert node.wait(2, waiter=w.waiter, deadline=math.inf).until == w.until


def test_a_spent_deadline_ends_a_new_wait_at_once_and_holds_no_place() -> None:
    node = Node(reorder_window=2)
    node.done(node.admit(0))
    node.now = 2.0
    with pytest.raises(SequencingError) as raised:
        node.offer(2, deadline=2.0)
    assert raised.value.code == "chunk_wait_timeout"
    node.wait(2)  # the window's one place to wait is still free


def test_without_a_deadline_a_wait_still_ends_though_the_session_keeps_progressing() -> None:
    """Short runs keep finishing (each a progress) while this chunk's turn never
    comes (it belongs to a run that never opens): the TTL bound ends it."""
    node = Node()
    far = 10**9  # a position it never reaches, yet never an impossible one
    w = node.wait(1, total=2, position=far)
    for k in range(int(TTL / (T / 2))):  # a one-chunk run every T / 2
        node.now = k * T / 2
        node.done(node.admit(0, total=1, position=TOKENS * k))
        w = node.wait(1, total=2, position=far, waiter=w.waiter)
        assert w.until == min(node.now + T, TTL)
    node.now = TTL
    err = node.times_out(w, total=2, position=far)
    assert err.message.endswith("until its deadline")


def test_a_reorder_timeout_beyond_the_ttl_still_bounds_a_wait_without_a_deadline() -> None:
    node = Node(reorder_timeout=2 * TTL)
    w = node.wait(1)
    assert w.until == 2 * TTL  # the longer of the two: the timeout is not cut short


def test_give_up_while_the_predecessor_is_in_the_stage_says_so() -> None:
    node = Node()
    node.admit(0)
    w = node.wait(1)
    node.now = 2 * T  # a driver cancelled mid-wait
    err = node.table.give_up(w.waiter, node.now)
    assert (
        err.message
        == f"session {S}: chunk 1 waited 2 s for chunk 0, while chunk 0 was in the stage"
    )


def test_other_sessions_compute_does_not_stop_a_session_s_timer() -> None:
    other = "5b1e0c2a-2222-4abc-8def-000000000002"
    node = Node()
    node.done(node.admit(0))
    node.admit(0, session=other)  # the node is busy, but not with this session
    w = node.wait(2)
    node.now = T
    assert node.times_out(w).code == "chunk_wait_timeout"


def test_an_ended_session_takes_its_timer_with_it() -> None:
    node = Node()
    node.done(node.admit(0))
    node.now = 10 * T
    node.table.end_session(S)
    node.now = 10.5 * T
    w = node.wait(1)  # the same id again, not started: its timer starts now
    assert w.until == 11.5 * T


# ------------------------------------------------------------------ a simulated node


@dataclass
class Sim:
    """A node that computes one admitted chunk at a time, FIFO over sessions,
    driven the way meshnet_node drives its table: sleep until woken (a chunk
    of the session left the stage) or until, then offer again."""

    computes: list[float]
    table: SessionTable = field(
        default_factory=lambda: SessionTable(
            Limits(reorder_window=4, reorder_timeout=T, session_ttl=600.0)
        )
    )
    now: float = 0.0
    events: list[tuple[float, int, str, Any]] = field(default_factory=list)
    seq: itertools.count = field(default_factory=itertools.count)
    queue: deque[Ticket] = field(default_factory=deque)
    running: Ticket | None = None
    ran: int = 0
    waiting: dict[int, tuple[WireHeaders, Waiter]] = field(default_factory=dict)
    order: dict[str, list[int]] = field(default_factory=dict)
    left_stage: dict[str, float] = field(default_factory=dict)
    ended: list[tuple[WireHeaders, Waiter | None, SequencingError, float]] = field(
        default_factory=list
    )

    def at(self, when: float, kind: str, data: Any = None) -> None:
        heapq.heappush(self.events, (when, next(self.seq), kind, data))

    def offer(self, h: WireHeaders, waiter: Waiter | None = None) -> None:
        digest = f"{h.session}:{h.chunk_index}".encode().ljust(16, b".")[:16]
        try:
            d = self.table.offer(h, digest, self.now, waiter=waiter, deadline=self.now + 1e6)
        except SequencingError as err:
            self.ended.append((h, waiter, err, self.now))
            return
        if isinstance(d, Wait):
            self.waiting[d.waiter.serial] = (h, d.waiter)
            self.at(d.until, "timer", (d.waiter.serial, d.until))
            return
        assert isinstance(d, Process), d
        self.queue.append(d.ticket)
        self.start()

    def start(self) -> None:
        if self.running is None and self.queue:
            self.running = self.queue.popleft()
            self.at(self.now + self.computes[self.ran % len(self.computes)], "done")
            self.ran += 1

    def run(self) -> None:
        while self.events:
            self.now, _, kind, data = heapq.heappop(self.events)
            if kind == "arrive":
                self.offer(data)
            elif kind == "timer":
                serial, until = data
                entry = self.waiting.get(serial)
                if entry is not None and entry[1].until == until:  # not a stale timer
                    del self.waiting[serial]
                    self.offer(*entry)
            else:
                t, self.running = self.running, None
                assert t is not None
                self.table.stage_done(t, "out", self.now)
                self.table.response_ready(t, "resp", self.now)
                self.order.setdefault(t.session, []).append(t.index)
                self.left_stage[t.session] = self.now
                for serial in sorted(self.waiting):  # wake the session's waiters
                    h, w = self.waiting[serial]
                    if w.session == t.session:
                        del self.waiting[serial]
                        self.offer(h, w)
                self.start()


def _sessions(data: st.DataObject) -> list[tuple[str, int, list[float]]]:
    """Per session: its id, its chunk total and each chunk's arrival time —
    all sent at once (the gateway's --inflight), arriving within 0.9 T."""
    out = []
    for k in range(data.draw(st.integers(1, 3))):
        total = data.draw(st.integers(2, 4))
        arrivals = data.draw(st.lists(st.floats(0, 0.9 * T), min_size=total, max_size=total))
        out.append((f"5b1e0c2a-{k:04d}-4abc-8def-000000000000", total, arrivals))
    return out


_COMPUTES = st.lists(st.floats(0, 5 * T), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), computes=_COMPUTES)
def test_a_well_behaved_client_never_gets_chunk_wait_timeout(
    data: st.DataObject, computes: list[float]
) -> None:
    """Every chunk arrives within the reorder timeout; the node takes up to
    5 T per chunk, one at a time, so a chunk may queue for many timeouts."""
    sim = Sim(computes)
    sessions = _sessions(data)
    for session, total, arrivals in sessions:
        for index, when in enumerate(arrivals):
            sim.at(when, "arrive", hdr(index, total, session=session))
    sim.run()
    assert sim.ended == []
    assert sim.order == {session: list(range(total)) for session, total, _ in sessions}
    assert sim.waiting == {} and len(sim.table) == len(sessions)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), computes=_COMPUTES)
def test_a_lost_chunk_ends_its_successors_waits_a_timeout_after_the_last_progress(
    data: st.DataObject, computes: list[float]
) -> None:
    sim = Sim(computes)
    sessions = _sessions(data)
    lost: dict[str, int] = {}
    arrived: dict[tuple[str, int], float] = {}
    for session, total, arrivals in sessions:
        lost[session] = data.draw(st.integers(0, total - 2))
        for index, when in enumerate(arrivals):
            if index != lost[session]:
                arrived[session, index] = when
                sim.at(when, "arrive", hdr(index, total, session=session))
    sim.run()
    for session, _, _ in sessions:
        assert sim.order.get(session, []) == list(range(lost[session]))
    expected = {(s, i) for s, total, _ in sessions for i in range(lost[s] + 1, total)}
    assert {(h.session, h.chunk_index) for h, *_ in sim.ended} == expected
    for h, waiter, err, when in sim.ended:
        assert h.session is not None and h.chunk_index is not None
        start = max(arrived[h.session, h.chunk_index], sim.left_stage.get(h.session, 0.0))
        assert when == pytest.approx(start + T)
        assert waiter is not None  # ended by an offer at until, not at arrival
        assert err.code == ("chunk_wait_timeout" if lost[h.session] else "session_unknown")
