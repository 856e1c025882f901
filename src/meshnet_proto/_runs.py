"""A session's chunk records across its runs (wire-2 §3): finding a
ticket's record, the answer to a retransmission of a chunk that ran, and
the window the records are trimmed to. Pure functions of the sessions and
the replay store.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from ._chunk_record import IN_FLIGHT, ChunkPhase, ChunkRecord
from ._claims import INDEX
from ._decisions import Decision, Join, Reforward, Replay, Ticket
from ._errors import ErrorCode, SequencingError
from ._replay_store import ReplayStore
from ._routing import KEPT_WINDOWS, Session

__all__ = ["lookup", "again", "all_records", "keep_window", "trim"]


def lookup(sessions: dict[str, Session], ticket: Ticket) -> tuple[Session, ChunkRecord] | None:
    """The session and record a ticket reports on, or None for a stale ticket."""
    s = sessions.get(ticket.session)
    if s is None:
        return None
    records = s.records if ticket.run == s.run else s.last_records
    record = records.get(ticket.index)
    if record is None or record.ticket.serial != ticket.serial:
        # An earlier window's (wire-2 §3.16), or a stale ticket: its run's
        # records were dropped.
        record = next((r for r in s.earlier if r.ticket.serial == ticket.serial), None)
        if record is None:
            return None
    return s, record


def all_records(s: Session) -> Iterator[ChunkRecord]:
    """Every record the session holds: its runs' and its earlier windows'."""
    return itertools.chain(s.records.values(), s.last_records.values(), s.earlier)


def keep_window(s: Session) -> list[ChunkRecord]:
    """A new run opens: the last run's chunk 0 joins ``s.earlier`` when the
    run was a window's (one chunk with ``X-Meshnet-After``, wire-2 §3.16),
    and the records that go are returned (the caller forgets their stored
    bytes). Plain runs keep §3.5's rule: the last run's records only."""
    gone = list(s.last_records.values())
    kept = s.last_records.get(0)
    if s.last_total == 1 and kept is not None and kept.window:
        gone.remove(kept)
        s.earlier.append(kept)
        while len(s.earlier) > KEPT_WINDOWS:
            gone.append(s.earlier.popleft())
    return gone


def again(record: ChunkRecord, store: ReplayStore) -> Decision:
    """The decision for an identical retransmission of ``record``'s chunk."""
    if record.phase in IN_FLIGHT:
        return Join(record.ticket)
    if record.phase is ChunkPhase.ANSWERED:
        return Replay(record.response)
    if record.phase is ChunkPhase.EVICTED:
        raise SequencingError(
            f"session {record.ticket.session}: chunk {record.ticket.index} already ran, "
            "but its answer or output is no longer kept (the node's stored-bytes budget)",
            code=ErrorCode.CHUNK_CONFLICT,
            header=INDEX,
        )
    return Reforward(record.ticket, store.reforward(record))


def trim(s: Session, window: int, store: ReplayStore) -> None:
    """Keep O(window) records per run (the memory bound of docs/sessions.md).

    A sender keeps at most a window of chunks unanswered, so only those can
    come again; chunk 0 stays for the no-position replay rule; a record in
    flight stays until the driver reports its outcome.
    """
    for records, floor in (
        (s.records, s.next_index - window),
        (s.last_records, s.last_total - window),
    ):
        if floor <= 1:
            continue  # no index in 0 < i < floor: a run within the window (every decode step's)
        for index in [i for i, r in records.items() if 0 < i < floor and r.phase not in IN_FLIGHT]:
            store.forget((records.pop(index),))
