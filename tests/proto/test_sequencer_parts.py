"""The parts ``SessionTable`` is composed of, each on its own.

The chunk-record table (every legal move, nothing else), the waiter
registry (who waits where; the count of waiters of unknown sessions) and
the replay store (whose stored-bytes ledger must equal, after any sequence
of moves, the bytes of the records it holds).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnet_proto._chunk_record import HELD, TRANSITIONS, ChunkPhase, ChunkRecord, move
from meshnet_proto._replay_store import ReplayStore
from meshnet_proto._waiters import Waiter, WaiterRegistry


@dataclass(frozen=True)
class _Ticket:
    serial: int


# ------------------------------------------------------------ chunk records


@pytest.mark.parametrize("phase", list(ChunkPhase))
@pytest.mark.parametrize(
    "event",
    ["stage_done", "stage_failed", "response_ready", "forward_failed", "reforward", "evict"],
)
def test_a_record_moves_exactly_as_the_table_says(phase: ChunkPhase, event: str) -> None:
    record = ChunkRecord(_Ticket(1), phase)
    if (phase, event) not in TRANSITIONS:
        with pytest.raises(ValueError, match=event):
            move(record, event)
        assert record.phase is phase
        return
    after = move(record, event)
    assert after is TRANSITIONS[phase, event]
    assert record.phase is (phase if after is None else after)


# ------------------------------------------------------------------ waiters


def _waiter(session: str, serial: int, until: float = 10.0) -> Waiter:
    return Waiter(session=session, index=1, since=0.0, until=until, end=until, serial=serial)


def test_waiters_of_unknown_sessions_are_counted_apart() -> None:
    registry = WaiterRegistry()
    a1, a2, b1 = _waiter("a", 1), _waiter("a", 2), _waiter("b", 3, until=5.0)
    registry.add(a1, known=False)
    registry.add(a2, known=False)
    registry.add(b1, known=True)
    assert (registry.count("a"), registry.count("b"), registry.pending) == (2, 1, 2)
    assert registry.waiting_at("b", 4.0) and not registry.waiting_at("b", 5.0)
    registry.session_started("a")  # a's chunk 0 ran: its waiters are no longer pending
    assert registry.pending == 0
    assert registry.remove(a1, known=True) and not registry.remove(a1, known=True)
    registry.drop("a", known=True)
    assert registry.count("a") == 0 and not registry.remove(a2, known=True)
    registry.add(_waiter("c", 4), known=False)
    registry.drop("c", known=False)  # a session that never started
    assert registry.pending == 0 and not registry.waiting_at("c", 0.0)


# ------------------------------------------------------------- replay store


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["answer", "fail", "reforward", "forget"]),
        st.integers(0, 7),  # which record
        st.integers(0, 60),  # bytes
    ),
    max_size=60,
)


@given(_OPS)
def test_the_ledger_is_the_bytes_of_the_records_it_holds(ops: list[tuple[str, int, int]]) -> None:
    store = ReplayStore(max_bytes=100)
    records = {i: ChunkRecord(_Ticket(i), ChunkPhase.FORWARDING) for i in range(8)}
    held: dict[int, int] = {}  # what the store must hold, as this test counts it
    for op, i, nbytes in ops:
        record = records[i]
        if op == "answer" and record.phase is ChunkPhase.FORWARDING:
            store.answered(record, f"answer {i}", nbytes)
        elif op == "fail" and record.phase is ChunkPhase.FORWARDING:
            record.stage_output = f"output {i}"
            store.forward_failed(record, nbytes)
        elif op == "reforward" and record.phase is ChunkPhase.FORWARD_FAILED:
            assert store.reforward(record) == f"output {i}"
            held.pop(i, None)
        elif op == "forget":
            store.forget([record])
            held.pop(i, None)
            records[i] = ChunkRecord(_Ticket(i + 100 * len(ops)), ChunkPhase.FORWARDING)
            continue
        else:
            continue
        if op in ("answer", "fail") and nbytes > 0:
            held[i] = nbytes
        # Evicted records hold nothing: the oldest went first.
        for j in [j for j in held if records[j].phase is ChunkPhase.EVICTED]:
            del held[j]
            assert records[j].response is None and records[j].stage_output is None
        assert store.stored_bytes == sum(held.values()) <= 100
        assert len(store) == len(held)
        assert all(records[j].phase in HELD for j in held)
