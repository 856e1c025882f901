"""SessionTable: wire-2 §3 sequencing, driven the way a node drives it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import xxhash
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from meshnet_proto import (
    CapacityError,
    Join,
    Limits,
    MeshnetError,
    Process,
    ProtocolError,
    Reforward,
    Replay,
    SequencingError,
    SessionTable,
    Wait,
    WireHeaders,
    tensor_fingerprint,
)
from meshnet_proto._capacity import Capacity
from meshnet_proto._decisions import new_ticket
from meshnet_proto._routing import Session
from meshnet_proto._sequencer import Ticket
from meshnet_proto._waiters import Waiter

S1 = "5b1e0c2a-1111-4abc-8def-000000000001"
S2 = "5b1e0c2a-2222-4abc-8def-000000000002"
S3 = "5b1e0c2a-3333-4abc-8def-000000000003"
TOKENS = 4
# hdr()'s default position: the chunk's place in a first run of TOKENS-token
# chunks (wire-2 §3.9: only a new session's chunk 0 may omit it).
NATURAL: Any = object()


def fp(tag: object) -> bytes:
    """A stand-in fingerprint: the table only compares them."""
    return str(tag).encode().ljust(16, b".")[:16]


def hdr(
    index: int,
    total: int = 4,
    *,
    session: str = S1,
    position: int | None = NATURAL,
    tokens: int = TOKENS,
    hidden: int = 8,
    dtype: str = "float32",
    shape: tuple[int, ...] | None = None,
    key: str | None = None,
) -> WireHeaders:
    if position is NATURAL:
        position = index * tokens
    return WireHeaders(
        shape=shape or (1, tokens, hidden),
        dtype=dtype,
        session=session,
        chunk_index=index,
        chunk_total=total,
        position=position,
        session_key=key,
    )


class Node:
    """A tiny synchronous driver with a hand-moved clock."""

    def __init__(self, limits: Limits | None = None, **kw: Any) -> None:
        self.table = SessionTable(limits, **kw)
        self.now = 0.0

    def offer(self, index: int, total: int = 4, *, tag: object = None, **kw: Any) -> Any:
        waiter = kw.pop("waiter", None)
        deadline = kw.pop("deadline", None)
        h = hdr(index, total, **kw)
        tag = index if tag is None else tag
        return self.table.offer(h, fp(tag), self.now, waiter=waiter, deadline=deadline)

    def head(self, index: int, total: int = 4, **kw: Any) -> None:
        self.table.check_head(hdr(index, total, **kw), self.now)

    def process(self, index: int, total: int = 4, **kw: Any) -> Ticket:
        decision = self.offer(index, total, **kw)
        assert isinstance(decision, Process), decision
        return decision.ticket

    def finish(self, ticket: Ticket) -> None:
        self.table.stage_done(ticket, f"out{ticket.index}", self.now)
        self.table.response_ready(ticket, f"resp{ticket.index}", self.now)

    def run(self, total: int = 4, *, session: str = S1, base: int = 0, tag: str = "") -> None:
        """One whole run, in order, every chunk answered."""
        for i in range(total):
            self.finish(
                self.process(i, total, session=session, position=base + TOKENS * i, tag=f"{tag}{i}")
            )


# -- fingerprints -------------------------------------------------------------------------


def test_fingerprint_is_the_decoded_tensor() -> None:
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    digest = tensor_fingerprint(a)
    assert isinstance(digest, bytes) and len(digest) == 16
    # Memory layout and byte order are not the tensor: same values, same digest.
    assert tensor_fingerprint(np.asfortranarray(a)) == digest
    assert tensor_fingerprint(a.astype(">f4")) == digest
    # Shape, dtype and values are.
    assert tensor_fingerprint(a.reshape(2, 4, 3)) != digest
    assert tensor_fingerprint(a.astype(np.int32)) != digest
    b = a.copy()
    b[1, 2, 3] += 1
    assert tensor_fingerprint(b) != digest
    bf = a.astype(ml_dtypes.bfloat16)
    assert tensor_fingerprint(bf) == tensor_fingerprint(bf.copy())
    assert tensor_fingerprint(bf) != tensor_fingerprint(bf.view(np.float16))


def test_fingerprint_framing_is_fixed() -> None:
    # The digest is XXH3-128 over "meshnet-tensor|<shape>|<dtype name>|" and
    # the little-endian element bytes: a change of it (or of its cache of the
    # framing) would make a retransmission look like another chunk.
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    expected = xxhash.xxh3_128(b"meshnet-tensor|2,3,4|float32|" + a.tobytes()).digest()
    assert tensor_fingerprint(a) == expected
    assert tensor_fingerprint(a.astype(">f4")) == expected  # the same framing from the cache
    other = xxhash.xxh3_128(b"meshnet-tensor|4,3,2|float32|" + a.tobytes()).digest()
    assert tensor_fingerprint(a.reshape(4, 3, 2)) == other


@pytest.mark.parametrize(
    "array",
    [
        np.zeros((1, 1, 8), dtype=ml_dtypes.bfloat16) + 1.5,  # a decode step's, hashed in place
        np.float32(2.5),  # zero-dimensional
        np.zeros((0, 4), dtype=np.int32),  # empty
        np.arange(6, dtype=np.float16).reshape(2, 3)[:, ::2],  # strided: copied first
    ],
)
def test_fingerprint_hashes_the_element_bytes_whatever_the_array(array: np.ndarray) -> None:
    # Hashed through the array's own buffer: the same digest as over its
    # little-endian C-order bytes, framed by shape and dtype name.
    a = np.asarray(array)
    shape = ",".join(map(str, a.shape)).encode()
    framing = b"meshnet-tensor|%b|%b|" % (shape, a.dtype.name.encode())
    expected = xxhash.xxh3_128(framing + np.ascontiguousarray(a).tobytes()).digest()
    assert tensor_fingerprint(array) == expected


def test_fingerprint_refuses_an_object_array() -> None:
    # Its buffer is pointers: hashing them would call equal tensors different.
    with pytest.raises(TypeError, match="holds objects"):
        tensor_fingerprint(np.array([1.0, None], dtype=object))


# -- the ordinary paths ---------------------------------------------------------------------


def test_in_order_runs_advance_the_position() -> None:
    node = Node()
    assert S1 not in node.table and node.table.position(S1) is None
    tickets = []
    for i in range(3):
        node.head(i, 3, position=TOKENS * i)
        ticket = node.process(i, 3, position=TOKENS * i)
        assert (ticket.session, ticket.run, ticket.index) == (S1, 0, i)
        assert (ticket.position, ticket.tokens, ticket.fingerprint) == (TOKENS * i, TOKENS, fp(i))
        node.finish(ticket)
        tickets.append(ticket)
    assert len({t.serial for t in tickets}) == 3
    assert node.table.position(S1) == 12 and S1 in node.table and len(node.table) == 1
    # A new run (one decode step) continues the context.
    step = node.process(0, 1, position=12, tokens=1, tag="decode")
    assert (step.run, step.position) == (1, 12)
    node.finish(step)
    assert node.table.position(S1) == 13


def test_only_a_new_sessions_first_chunk_may_omit_its_position() -> None:
    node = Node()
    node.head(0, 2, position=None)
    node.finish(node.process(0, 2, position=None))
    assert node.table.position(S1) == 4
    # wire-2 §3.9: any other chunk without a position is refused from the head.
    for index, total in ((1, 2), (0, 1)):
        for check in (node.head, node.offer):
            with pytest.raises(SequencingError) as err:
                check(index, total, position=None)
            assert (err.value.status, err.value.code) == (409, "position_required")
            assert err.value.header == "x-meshnet-position"
    with pytest.raises(SequencingError) as err:  # unknown session, index > 0: too
        node.head(1, 2, position=None, session=S2)
    assert err.value.code == "position_required"
    node.finish(node.process(1, 2, position=4))
    assert node.table.position(S1) == 8


def test_out_of_order_chunk_waits_for_its_predecessor() -> None:
    node = Node()
    node.head(2, position=8)
    early = node.offer(2, position=8)
    assert isinstance(early, Wait) and early.until == 10.0 and early.waiter.until == 10.0
    one = node.offer(1, position=4, deadline=3.0)
    assert isinstance(one, Wait) and one.until == 3.0
    t0 = node.process(0, position=0)
    node.now = 1.0
    # Woken too early: still waiting, same waiter, same deadline.
    again = node.offer(1, position=4, waiter=one.waiter)
    assert again == Wait(one.waiter, 3.0)
    node.finish(t0)
    t1 = node.offer(1, position=4, waiter=one.waiter)
    assert isinstance(t1, Process) and t1.ticket.position == 4
    assert isinstance(node.offer(2, position=8, waiter=early.waiter), Wait)
    node.finish(t1.ticket)
    t2 = node.offer(2, position=8, waiter=early.waiter)
    assert isinstance(t2, Process) and t2.ticket.index == 2


def test_chunks_of_a_new_session_or_run_wait_for_chunk_0() -> None:
    node = Node()
    waiting = node.offer(1, 2, position=4)
    assert isinstance(waiting, Wait) and S1 not in node.table
    node.finish(node.process(0, 2, position=0))
    node.finish(node.offer(1, 2, position=4, waiter=waiting.waiter).ticket)
    # Between runs: the next run's chunk 1 waits for its chunk 0.
    nxt = node.offer(1, 2, position=12, tag="n1")
    assert isinstance(nxt, Wait)
    node.finish(node.process(0, 2, position=8, tag="n0"))
    assert isinstance(node.offer(1, 2, position=12, tag="n1", waiter=nxt.waiter), Process)


def test_next_chunk_runs_while_its_predecessor_is_downstream() -> None:
    node = Node()
    t0 = node.process(0, position=0)
    node.table.stage_done(t0, "out0", node.now)  # chunk 0 now FORWARDING
    t1 = node.process(1, position=4)
    node.table.stage_done(t1, "out1", node.now)
    t2 = node.process(2, position=8)
    # Answers come back in any order.
    node.table.response_ready(t1, "resp1", node.now)
    node.table.response_ready(t0, "resp0", node.now)
    assert t2.index == 2


def test_retransmissions_join_reforward_and_replay() -> None:
    node = Node()
    t0 = node.process(0, position=0)
    assert node.offer(0, position=0) == Join(t0)  # stage running
    assert node.offer(0) == Join(t0)  # without a position too
    node.table.stage_done(t0, "out0", node.now)
    assert node.offer(0, position=0) == Join(t0)  # downstream
    node.table.forward_failed(t0, node.now)
    assert node.offer(0, position=0) == Reforward(t0, "out0")
    assert node.offer(0, position=0) == Join(t0)  # the reforward is in flight
    node.table.forward_failed(t0, node.now)
    assert node.offer(0, position=0) == Reforward(t0, "out0")
    node.table.response_ready(t0, "resp0", node.now)
    assert node.offer(0, position=0) == Replay("resp0")
    assert node.table.position(S1) == TOKENS  # the stage ran once


def test_stage_failure_lets_a_retransmission_run_it_again() -> None:
    node = Node()
    t0 = node.process(0, position=0)
    node.table.stage_failed(t0, node.now)
    assert node.table.position(S1) == 0
    # The failed chunk 0 never opened the run: another shape may start it.
    t0b = node.process(0, 2, position=0, hidden=16, tag="b")
    node.finish(t0b)
    t1 = node.process(1, 2, position=4, hidden=16)
    node.table.stage_failed(t1, node.now)
    t1b = node.process(1, 2, position=4, hidden=16)
    assert t1b.serial != t1.serial
    # The stale ticket is ignored now.
    node.table.stage_failed(t1, node.now)
    node.finish(t1b)
    assert node.table.position(S1) == 8


def test_last_run_is_replayed_until_the_next_run_starts() -> None:
    node = Node()
    node.run(2, tag="a")
    # With positions: any chunk of the last run.
    assert node.offer(1, 2, position=4, tag="a1") == Replay("resp1")
    assert node.offer(0, 2, position=0, tag="a0") == Replay("resp0")
    # Without a position: refused, it could be either (wire-2 §3.9).
    with pytest.raises(SequencingError) as err:
        node.offer(0, 2, position=None, tag="a0")
    assert err.value.code == "position_required"
    # A different chunk 0 is the next run, and the last run is dropped.
    t = node.process(0, 2, position=8, tag="b0")
    assert (t.run, t.position) == (1, 8)
    with pytest.raises(SequencingError) as err:
        node.offer(0, 2, position=0, tag="a0")
    assert (err.value.status, err.value.code) == (409, "position_mismatch")


def test_last_run_chunk_with_a_new_position_and_tensor_is_the_next_run() -> None:
    node = Node()
    node.run(2, tag="a")
    assert isinstance(node.offer(1, 2, position=12, tag="b1"), Wait)
    # The last run's chunk 1 at its position and identical is a replay.
    assert node.offer(1, 2, position=4, tag="a1") == Replay("resp1")


def test_last_run_chunk_with_another_total_is_not_a_replay() -> None:
    # The stored answer says total 2: replaying it to a sender whose run has
    # another total would hand back an answer for a run it never sent.
    node = Node()
    node.run(2, tag="a")
    with pytest.raises(SequencingError) as err:
        node.offer(0, 3, position=0, tag="a0")
    assert (err.value.status, err.value.code) == (409, "chunk_conflict")
    # At the session's position it is simply the next run's chunk 0.
    t = node.process(0, 3, position=8, tag="a0")
    assert (t.run, t.position) == (1, 8)


def test_last_run_chunk_still_in_flight_is_joined() -> None:
    node = Node()
    t0 = node.process(0, 1, position=0)
    node.table.stage_done(t0, "out0", node.now)
    assert node.table.position(S1) == 4
    assert node.offer(0, 1, position=0) == Join(t0)
    node.table.forward_failed(t0, node.now)
    assert node.offer(0, 1) == Reforward(t0, "out0")
    node.table.response_ready(t0, "resp0", node.now)
    assert node.offer(0, 1) == Replay("resp0")
    # The next run drops the last run: its late outcome reports are ignored.
    nxt = node.process(0, 1, position=4, tag="next")
    node.table.response_ready(t0, "late", node.now)
    node.table.forward_failed(t0, node.now)
    node.table.stage_done(t0, "late", node.now)
    node.finish(nxt)
    assert node.table.position(S1) == 8


def test_records_are_bounded_by_the_window() -> None:
    node = Node(Limits(reorder_window=2))
    node.run(6, tag="a")
    # Chunk 0 and the last two chunks are kept; the others are gone.
    assert node.offer(0, 6, tag="a0") == Replay("resp0")
    assert node.offer(5, 6, position=20, tag="a5") == Replay("resp5")
    assert node.offer(4, 6, position=16, tag="a4") == Replay("resp4")
    with pytest.raises(SequencingError) as err:
        node.offer(2, 6, position=8, tag="a2")  # dropped: as far as the node can tell, too far
    assert err.value.code == "chunk_out_of_window"
    # A record in flight is never dropped, however far behind.
    node.finish(node.process(0, 6, position=24, tag="b0"))
    t1 = node.process(1, 6, position=28, tag="b1")
    node.table.stage_done(t1, "out1", node.now)
    for i in range(2, 5):
        node.finish(node.process(i, 6, position=24 + 4 * i, tag=f"b{i}"))
    assert node.offer(1, 6, position=28, tag="b1") == Join(t1)
    with pytest.raises(SequencingError) as err:
        node.offer(2, 6, position=32, tag="b2")
    assert (err.value.status, err.value.code) == (409, "chunk_conflict")
    node.table.response_ready(t1, "resp1", node.now)  # settled, behind the window: dropped
    with pytest.raises(SequencingError) as err:
        node.offer(1, 6, position=28, tag="b1")
    assert err.value.code == "chunk_conflict"


# -- waiters: timeouts, ending, bounds ---------------------------------------------------------


def test_a_wait_that_runs_out_names_the_chunk_waited_for() -> None:
    node = Node()
    node.finish(node.process(0, position=0))
    node.finish(node.process(1, position=4))
    wait = node.offer(3, position=12)
    node.now = 10.0  # offered again at its until: the offer ends the wait
    with pytest.raises(SequencingError) as raised:
        node.offer(3, position=12, waiter=wait.waiter)
    err = raised.value
    assert (err.status, err.code, err.header) == (
        409,
        "chunk_wait_timeout",
        "x-meshnet-chunk-index",
    )
    assert err.message == (
        f"session {S1}: chunk 3 waited 10 s for chunk 2, the last 10 s without progress"
    )
    # The wait is over, the waiter gone: its slot is free, its session unknown to it.
    assert node.table.give_up(wait.waiter, node.now).code == "session_unknown"


def test_give_up_names_the_chunk_waited_for() -> None:
    node = Node()
    node.finish(node.process(0, position=0))
    node.finish(node.process(1, position=4))
    wait = node.offer(3, position=12)
    node.now = 4.0  # a driver cancelled before the wait ran out
    err = node.table.give_up(wait.waiter, node.now)
    assert (err.status, err.code) == (409, "chunk_wait_timeout")
    assert err.message == (
        f"session {S1}: chunk 3 waited 4 s for chunk 2, the last 4 s without progress"
    )
    assert node.table.give_up(wait.waiter, node.now).code == "session_unknown"


def test_give_up_for_a_session_that_never_started() -> None:
    node = Node()
    wait = node.offer(2, position=8)
    node.now = 2.5
    err = node.table.give_up(wait.waiter, node.now)
    assert (err.status, err.code) == (409, "session_unknown")
    assert "never started" in err.message and "2.5 s" in err.message


def test_end_session_wakes_waiters_with_session_unknown() -> None:
    node = Node()
    node.process(0, position=0)
    wait = node.offer(2, position=8)
    assert node.table.end_session(S1) is True
    assert node.table.end_session(S1) is False
    assert S1 not in node.table and len(node.table) == 0
    with pytest.raises(SequencingError) as err:
        node.offer(2, position=8, waiter=wait.waiter)
    assert (err.value.status, err.value.code) == (409, "session_unknown")
    assert node.table.give_up(wait.waiter, node.now).code == "session_unknown"


def test_end_session_drops_waiters_of_a_session_that_never_started() -> None:
    node = Node(max_pending_waiters=1)
    wait = node.offer(2, position=8)
    assert node.table.end_session(S1) is False
    with pytest.raises(SequencingError) as err:
        node.offer(2, position=8, waiter=wait.waiter)
    assert err.value.code == "session_unknown"
    # Its slot in the pending pool is free again.
    assert isinstance(node.offer(1, session=S2), Wait)


def test_pending_waiters_move_into_the_session_when_it_starts() -> None:
    node = Node(Limits(reorder_window=4), max_pending_waiters=2)
    w1 = node.offer(1, position=4).waiter
    w2 = node.offer(2, position=8).waiter
    with pytest.raises(CapacityError) as err:
        node.offer(1, session=S2)
    assert (err.value.status, err.value.code, err.value.retry_after) == (503, "sessions_full", 10)
    with pytest.raises(CapacityError):
        node.head(1, session=S2)
    t0 = node.process(0, position=0)  # S1 starts: its waiters leave the pending pool
    assert isinstance(node.offer(1, session=S2), Wait)
    assert isinstance(node.offer(1, position=4, waiter=w1), Wait)
    node.finish(t0)
    assert isinstance(node.offer(1, position=4, waiter=w1), Process)
    assert node.table.give_up(w2, node.now).code == "chunk_wait_timeout"


def test_waiters_per_session_are_bounded_by_the_window() -> None:
    node = Node(Limits(reorder_window=3))
    node.process(0, position=0)
    waits = [node.offer(i, position=4 * i) for i in (1, 2)]
    waits.append(node.offer(2, position=8))  # a retransmission waits too
    with pytest.raises(SequencingError) as err:
        node.head(1, position=4)
    assert (err.value.status, err.value.code) == (409, "chunk_out_of_window")
    # A returning waiter is counted once, not once per offer.
    for w in waits:
        assert isinstance(
            node.offer(w.waiter.index, position=4 * w.waiter.index, waiter=w.waiter), Wait
        )
    node.table.give_up(waits[0].waiter, node.now)
    assert isinstance(node.offer(1, position=4), Wait)


def test_waiter_that_turns_out_wrong_is_refused_at_its_turn() -> None:
    node = Node()
    wait = node.offer(1, 3)  # total 3, while chunk 0 will say 4
    node.finish(node.process(0, 4))
    with pytest.raises(SequencingError) as err:
        node.offer(1, 3, waiter=wait.waiter)
    assert (err.value.code, err.value.header) == ("run_mismatch", "x-meshnet-chunk-total")
    # It is no longer a waiter.
    assert node.table.give_up(wait.waiter, node.now).code == "session_unknown"


def test_a_waiter_belongs_to_one_chunk() -> None:
    node = Node()
    wait = node.offer(2)
    with pytest.raises(ValueError):
        node.offer(3, waiter=wait.waiter)


# -- capacity and expiry -----------------------------------------------------------------------


def test_full_table_answers_503_until_a_session_expires() -> None:
    node = Node(Limits(max_sessions=2, session_ttl=100.0))
    node.run(1, session=S1)
    node.now = 30.0
    node.run(1, session=S2)
    node.now = 50.0
    with pytest.raises(CapacityError) as err:
        node.head(0, session=S3)
    assert (err.value.status, err.value.code, err.value.retry_after) == (503, "sessions_full", 50)
    with pytest.raises(CapacityError):
        node.offer(0, session=S3)
    node.now = 100.5  # S1 idle 100.5 s > ttl: the new session's offer expires it
    node.process(0, session=S3)
    assert S1 not in node.table and len(node.table) == 2


def test_busy_sessions_do_not_expire() -> None:
    node = Node(Limits(max_sessions=1, session_ttl=5.0, reorder_timeout=10.0))
    t0 = node.process(0, position=0)
    node.now = 100.0
    assert node.table.expire(node.now) == []  # stage running
    node.table.stage_done(t0, "out0", 0.0)
    assert node.table.expire(node.now) == []  # downstream
    node.table.response_ready(t0, "resp0", 0.0)
    wait = node.offer(2, position=8)  # touches the session at 100
    node.now = 108.0  # idle 8 s > ttl, but the waiter's time is not up
    assert node.table.expire(node.now) == []
    with pytest.raises(CapacityError) as err:
        node.offer(0, session=S2)
    assert err.value.retry_after == 5  # a busy session counts as just touched
    node.now = 111.0  # the waiter is overdue: the session is idle
    assert node.table.expire(node.now) == [S1]
    with pytest.raises(SequencingError):
        node.offer(2, position=8, waiter=wait.waiter)


def test_capacity_retry_after_is_at_least_one_second() -> None:
    node = Node(Limits(max_sessions=1, session_ttl=1.0))
    node.run(1)
    node.now = 0.9999
    with pytest.raises(CapacityError) as err:
        node.offer(0, session=S2)
    assert err.value.retry_after == 1


def test_a_full_table_does_not_rescan_every_session_per_refused_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Issue 5: 10,000 new sessions at once against a full table each cost a
    # scan of max_sessions sessions; the verdict is reused until it can change.
    sessions = 64
    node = Node(Limits(max_sessions=sessions, session_ttl=100.0))
    for i in range(sessions):
        node.run(1, session=f"00000000-0000-4000-8000-{i:012d}")
    scans = 0
    busy = Capacity.busy

    def counting(self: Capacity, s: Session, now: float) -> bool:
        nonlocal scans
        scans += 1
        return busy(self, s, now)

    monkeypatch.setattr(Capacity, "busy", counting)
    for attempt in range(1000):
        node.now = 10.0 + attempt / 10_000  # all within the reuse window
        with pytest.raises(CapacityError) as err:
            node.head(0, session=S2)
        assert err.value.retry_after == math.ceil(100.0 - node.now)
    assert 0 < scans <= 2 * sessions  # one expire() and one min() scan, not 1000
    # Past the window the table is looked at again (and still full).
    before = scans
    node.now = 12.0
    with pytest.raises(CapacityError):
        node.head(0, session=S2)
    assert scans > before


def test_a_busy_session_turning_idle_frees_its_slot_within_the_reuse_window() -> None:
    node = Node(Limits(max_sessions=1, session_ttl=5.0, reorder_timeout=10.0))
    t0 = node.process(0, position=0)
    node.table.stage_done(t0, "out0", 0.0)
    node.table.response_ready(t0, "resp0", 0.0)
    node.offer(2, position=8)  # a waiter until 10.0: busy
    node.now = 9.5
    with pytest.raises(CapacityError):
        node.offer(0, session=S2)  # verdict cached until at most 10.5
    node.now = 10.2  # the waiter is overdue, the session idle 10.2 s > ttl
    with pytest.raises(CapacityError):
        node.offer(0, session=S2)  # still within the 1 s reuse window
    node.now = 10.6
    assert isinstance(node.offer(0, session=S2), Process)
    assert S1 not in node.table


def test_stale_tickets_after_end_session_are_ignored() -> None:
    node = Node()
    old = node.process(0, position=0)
    node.table.end_session(S1)
    node.table.stage_done(old, "x", node.now)  # no session any more: nothing to do
    assert S1 not in node.table
    new = node.process(0, position=0)
    assert (old.run, old.index) == (new.run, new.index) and old != new
    node.table.stage_done(old, "x", node.now)
    node.table.response_ready(old, "x", node.now)
    node.table.forward_failed(old, node.now)
    node.table.stage_failed(old, node.now)
    assert node.table.position(S1) == 0
    node.finish(new)
    assert node.table.position(S1) == 4


def test_outcomes_out_of_turn_are_driver_bugs() -> None:
    node = Node()
    t0 = node.process(0, position=0)
    with pytest.raises(ValueError):
        node.table.response_ready(t0, "r", node.now)
    with pytest.raises(ValueError):
        node.table.forward_failed(t0, node.now)
    node.table.stage_done(t0, "out", node.now)
    with pytest.raises(ValueError):
        node.table.stage_done(t0, "out", node.now)
    with pytest.raises(ValueError):
        node.table.stage_failed(t0, node.now)


def test_pending_waiter_bound_must_be_positive() -> None:
    with pytest.raises(ValueError):
        SessionTable(max_pending_waiters=0)
    assert SessionTable().max_pending_waiters == 4 * Limits().reorder_window


# -- every bad input, with its status and code ---------------------------------------------------


@dataclass(frozen=True)
class DuckHeaders:
    """Headers as the table sees them (it only reads these attributes)."""

    shape: tuple[int, ...]
    dtype: str
    session: str | None
    chunk_index: int | None
    chunk_total: int | None
    position: int | None = None

    @property
    def tokens(self) -> int:
        return self.shape[1 if len(self.shape) >= 2 else 0]


def _open_run(node: Node) -> None:
    node.finish(node.process(0, position=0))  # run of 4 open, next index 1


def _finished_run(node: Node) -> None:
    node.run(2)  # position 8, last run kept


def _fresh(node: Node) -> None:
    pass


def _full(node: Node) -> None:
    node.table.offer(hdr(0, 1, session=S2), fp("s2"), node.now)


def _window_full(node: Node) -> None:
    _open_run(node)
    for _ in range(2):
        node.offer(2, position=8)


def _pending_full(node: Node) -> None:
    node.offer(1, session=S2)


def _in_flight(node: Node) -> None:
    _open_run(node)
    node.process(1, position=4)


def _trimmed(node: Node) -> None:
    for i in range(4):
        node.finish(node.process(i, 8, position=4 * i))


BAD: list[tuple[str, Callable[[Node], None], Any, bytes, int, str, bool]] = [
    # (name, setup, headers, fingerprint, status, code, the head check sees it)
    (
        "index 0 at position > 0 of an unknown session",
        _fresh,
        hdr(0, position=4),
        fp(0),
        409,
        "session_unknown",
        True,
    ),
    ("beyond the window, unknown session", _fresh, hdr(2), fp(2), 409, "chunk_out_of_window", True),
    ("beyond the window, open run", _open_run, hdr(3), fp(3), 409, "chunk_out_of_window", True),
    (
        "beyond the window, between runs",
        _finished_run,
        hdr(2),
        fp(2),
        409,
        "chunk_out_of_window",
        True,
    ),
    ("changed total", _open_run, hdr(1, 5), fp(1), 409, "run_mismatch", True),
    ("changed dtype", _open_run, hdr(1, dtype="float16"), fp(1), 409, "run_mismatch", True),
    ("changed trailing dimension", _open_run, hdr(1, hidden=16), fp(1), 409, "run_mismatch", True),
    ("changed rank", _open_run, hdr(1, shape=(1, 4, 8, 1)), fp(1), 409, "run_mismatch", True),
    (
        "position differs at its turn",
        _open_run,
        hdr(1, position=5),
        fp(1),
        409,
        "position_mismatch",
        True,
    ),
    (
        "position too small for a later chunk",
        _in_flight,
        hdr(2, position=4),
        fp(2),
        409,
        "position_mismatch",
        True,
    ),
    (
        "passed chunk, other position",
        _open_run,
        hdr(0, position=1),
        fp(0),
        409,
        "position_mismatch",
        True,
    ),
    (
        "in-flight chunk, other position",
        _in_flight,
        hdr(1, position=0),
        fp(1),
        409,
        "position_mismatch",
        True,
    ),
    (
        "next run at the wrong position",
        _finished_run,
        hdr(0, 2, position=3),
        fp("x"),
        409,
        "position_mismatch",
        True,
    ),
    (
        "passed chunk, other tensor",
        _open_run,
        hdr(0, position=0),
        fp("x"),
        409,
        "chunk_conflict",
        False,
    ),
    ("in-flight chunk, other tensor", _in_flight, hdr(1), fp("x"), 409, "chunk_conflict", False),
    (
        "last run's chunk, other tensor",
        _finished_run,
        hdr(1, 2, position=4),
        fp("x"),
        409,
        "chunk_conflict",
        False,
    ),
    ("passed chunk no longer kept", _trimmed, hdr(1, 8), fp(1), 409, "chunk_conflict", True),
    ("table full", _full, hdr(0), fp(0), 503, "sessions_full", True),
    ("chunk of a new session, table full", _full, hdr(1), fp(1), 503, "sessions_full", True),
    ("too many waiters", _window_full, hdr(2, position=8), fp(2), 409, "chunk_out_of_window", True),
    (
        "too many waiters for unstarted sessions",
        _pending_full,
        hdr(1),
        fp(1),
        503,
        "sessions_full",
        True,
    ),
    ("no session header", _fresh, hdr(0, session=None), fp(0), 400, "missing_header", True),
    (
        "no chunk headers",
        _fresh,
        WireHeaders(shape=(1, 4, 8), dtype="float32", session=S1),
        fp(0),
        400,
        "missing_header",
        True,
    ),
    (
        "index not below total",
        _fresh,
        DuckHeaders((1, 4, 8), "float32", S1, 4, 4),
        fp(0),
        400,
        "bad_chunk_index",
        True,
    ),
]


@pytest.mark.parametrize(
    ("setup", "headers", "fingerprint", "status", "code", "head_sees_it"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD],
)
def test_bad_sequencing_input(
    setup: Callable[[Node], None],
    headers: Any,
    fingerprint: bytes,
    status: int,
    code: str,
    head_sees_it: bool,
) -> None:
    node = Node(Limits(reorder_window=2, max_sessions=1), max_pending_waiters=1)
    setup(node)
    if head_sees_it:
        with pytest.raises(MeshnetError) as err:
            node.table.check_head(headers, node.now)
        assert (err.value.status, err.value.code) == (status, code)
    else:
        node.table.check_head(headers, node.now)
    with pytest.raises(MeshnetError) as err:
        node.table.offer(headers, fingerprint, node.now)
    assert (err.value.status, err.value.code) == (status, code)
    assert err.value.header is None or err.value.header.startswith("x-meshnet-")
    expected = {400: ProtocolError, 409: SequencingError, 503: CapacityError}[status]
    assert isinstance(err.value, expected)
    if status == 503:
        assert err.value.retry_after is not None and err.value.retry_after >= 1


# -- a property: random interleavings keep every session's chunks in order -----------------------

SESSIONS = (S1, S2)
TOTAL = 5


class Interleavings(RuleBasedStateMachine):
    """Senders retransmit, reorder and change their minds; a driver reports
    outcomes in any order. Whatever happens, the stage runs each session's
    chunks in index order, one at a time, and only MeshnetErrors come out."""

    def __init__(self) -> None:
        super().__init__()
        self.table = SessionTable(
            Limits(reorder_window=3, session_ttl=50.0, reorder_timeout=5.0), max_pending_waiters=4
        )
        self.now = 0.0
        self.next: dict[str, int] = {}  # model: the next index to run, per known session
        self.running: dict[str, Ticket] = {}
        self.forwarding: set[Ticket] = set()
        self.waiting: dict[int, tuple[WireHeaders, bytes, Waiter]] = {}

    def _offer(self, h: WireHeaders, digest: bytes, waiter: Waiter | None = None) -> None:
        try:
            decision = self.table.offer(h, digest, self.now, waiter=waiter)
        except MeshnetError:
            return
        if isinstance(decision, Process):
            t = decision.ticket
            assert t.session not in self.running, "two chunks of a session at once"
            assert t.index == self.next.setdefault(t.session, 0), "out of index order"
            self.running[t.session] = t
        elif isinstance(decision, Wait):
            self.waiting[decision.waiter.serial] = (h, digest, decision.waiter)
        elif isinstance(decision, Reforward):
            self.forwarding.add(decision.ticket)

    @rule(
        session=st.sampled_from(SESSIONS),
        offset=st.sampled_from([0, 0, 0, 0, 1, 2, 3, -1, -2]),
        variant=st.sampled_from([0, 0, 0, 1]),
        position_kind=st.sampled_from(["none", "right", "right", "wrong"]),
    )
    def send(self, session: str, offset: int, variant: int, position_kind: str) -> None:
        # Mostly what a sender would send next (or soon, or again), sometimes not.
        nxt = self.next.get(session, 0)
        index = min(max(nxt + offset, 0), TOTAL - 1)
        position = {
            "none": None,
            "right": (self.table.position(session) or 0) + (index - nxt) * 2,
            "wrong": 1,
        }[position_kind]
        h = hdr(index, TOTAL, session=session, tokens=2, position=position)
        try:
            self.table.check_head(h, self.now)
        except MeshnetError:
            return
        self._offer(h, fp((session, index, variant)))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def wake(self, data: st.DataObject) -> None:
        serial = data.draw(st.sampled_from(sorted(self.waiting)))
        h, digest, waiter = self.waiting.pop(serial)
        if data.draw(st.sampled_from([True, True, True, False])):
            self._offer(h, digest, waiter)
        else:
            assert isinstance(self.table.give_up(waiter, self.now), SequencingError)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), ok=st.sampled_from([True, True, True, False]))
    def stage_outcome(self, data: st.DataObject, ok: bool) -> None:
        session = data.draw(st.sampled_from(sorted(self.running)))
        t = self.running.pop(session)
        if not ok:
            self.table.stage_failed(t, self.now)
            return
        self.table.stage_done(t, ("out", t.serial), self.now)
        self.next[session] = (t.index + 1) % TOTAL
        self.forwarding.add(t)

    @precondition(lambda self: self.forwarding)
    @rule(data=st.data(), ok=st.booleans())
    def forward_outcome(self, data: st.DataObject, ok: bool) -> None:
        t = data.draw(st.sampled_from(sorted(self.forwarding, key=lambda t: t.serial)))
        self.forwarding.discard(t)
        if ok:
            self.table.response_ready(t, ("resp", t.serial), self.now)
        else:
            self.table.forward_failed(t, self.now)

    @rule(
        session=st.sampled_from(SESSIONS),
        what=st.sampled_from(["tick", "tick", "tick", "delete"]),
        dt=st.floats(0.0, 30.0),
    )
    def disrupt(self, session: str, what: str, dt: float) -> None:
        if what == "delete":
            self.table.end_session(session)
            self._forget(session)
            return
        self.now += dt
        for expired in self.table.expire(self.now):
            self._forget(expired)

    def _forget(self, session: str) -> None:
        self.next.pop(session, None)
        self.running.pop(session, None)  # its outcome reports are now stale

    @invariant()
    def model_matches(self) -> None:
        for session in SESSIONS:
            assert (session in self.table) == (session in self.next)


Interleavings.TestCase.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
test_interleavings = Interleavings.TestCase


def test_on_forget_is_told_every_way_a_session_goes() -> None:
    """DELETE, TTL expiry and the expiry that makes room for a new session all
    call on_forget once per known session (a model stage frees its KV cache there)."""
    forgotten: list[str] = []
    table = SessionTable(Limits(max_sessions=2, session_ttl=10.0), on_forget=forgotten.append)

    class H:
        shape = (1, 2)
        dtype = "int32"
        chunk_index = 0
        chunk_total = 1
        position = 0
        tokens = 2
        session_key = None
        prefix = None
        after = None

        def __init__(self, session: str) -> None:
            self.session = session

    def start(sid: str, now: float) -> None:
        decision = table.offer(H(sid), b"f" * 16, now)
        assert isinstance(decision, Process)
        table.stage_done(decision.ticket, None, now)
        table.response_ready(decision.ticket, object(), now)

    start("a", 0.0)
    start("b", 0.0)
    assert table.end_session("a") and forgotten == ["a"]
    assert not table.end_session("a") and forgotten == ["a"]  # unknown: not told again
    start("c", 5.0)
    assert table.expire(12.0) == ["b"] and forgotten == ["a", "b"]
    start("d", 13.0)  # table full with c, d
    start("e", 30.0)  # makes room: c and d are idle past the TTL
    assert sorted(forgotten) == ["a", "b", "c", "d"]


def test_an_answer_evicted_by_the_stored_bytes_budget_is_refused_not_rerun() -> None:
    node = Node(Limits(max_stored_bytes=100))
    first = node.process(0)
    node.table.stage_done(first, "out0", node.now)
    node.table.response_ready(first, "resp0", node.now, nbytes=60)
    assert node.table.stored_bytes == 60
    second = node.process(1)
    node.table.stage_done(second, "out1", node.now)
    node.table.response_ready(second, "resp1", node.now, nbytes=60)
    assert node.table.stored_bytes == 60  # chunk 0's answer went to make room
    assert node.offer(1) == Replay("resp1")
    with pytest.raises(SequencingError) as err:
        node.offer(0)
    assert err.value.code == "chunk_conflict"


def test_the_tables_tickets_equal_constructed_ones() -> None:
    """The table builds its tickets by their slots (new_ticket): the same
    value, hash and repr as the constructor's, and as frozen."""
    values = {"session": S1, "run": 2, "index": 1, "position": 12, "tokens": 4,
              "fingerprint": b"\x01" * 16, "serial": 9}  # fmt: skip
    fast = new_ticket(*values.values())
    built = Ticket(**values)  # type: ignore[arg-type]
    assert fast == built and hash(fast) == hash(built) and repr(fast) == repr(built)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.run = 3  # type: ignore[misc]
