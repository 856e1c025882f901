"""A session's chunk records across its runs (wire-2 §3): finding a
ticket's record, the answer to a retransmission of a chunk that ran, and
the window the records are trimmed to. Pure functions of the sessions and
the replay store.
"""

from __future__ import annotations

from ._chunk_record import IN_FLIGHT, ChunkPhase, ChunkRecord
from ._claims import INDEX
from ._decisions import Decision, Join, Reforward, Replay, Ticket
from ._errors import SequencingError
from ._replay_store import ReplayStore
from ._routing import Session

__all__ = ["lookup", "again", "trim"]


def lookup(sessions: dict[str, Session], ticket: Ticket) -> tuple[Session, ChunkRecord] | None:
    """The session and record a ticket reports on, or None for a stale ticket."""
    s = sessions.get(ticket.session)
    if s is None:
        return None
    records = s.records if ticket.run == s.run else s.last_records
    record = records.get(ticket.index)
    if record is None or record.ticket.serial != ticket.serial:
        return None  # a stale ticket: its run's records were dropped
    return s, record


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
            code="chunk_conflict",
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
