"""The life of one chunk at a node, as a table (wire-2 §3).

A chunk that ran is a *record*: its ticket, its phase, and what it keeps
for a retransmission (the stage output, the answer). Every legal move of a
record is one row of ``TRANSITIONS``; a move not listed is a driver bug
(``ValueError``), never a peer's doing.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = ["HELD", "IN_FLIGHT", "TRANSITIONS", "ChunkPhase", "ChunkRecord", "move"]


class ChunkPhase(Enum):
    RUNNING = "running"  # the stage is running on the chunk
    FORWARDING = "forwarding"  # stage done; its output is downstream (or being answered)
    FORWARD_FAILED = "forward_failed"  # stage output kept for a reforward
    ANSWERED = "answered"  # success response kept for a replay
    EVICTED = "evicted"  # its response or kept output went to keep the byte budget


_P = ChunkPhase
# (phase, event) -> next phase; None = the record is forgotten.
TRANSITIONS: dict[tuple[ChunkPhase, str], ChunkPhase | None] = {
    (_P.RUNNING, "stage_done"): _P.FORWARDING,
    (_P.RUNNING, "stage_failed"): None,  # a retransmission may run it again
    (_P.FORWARDING, "response_ready"): _P.ANSWERED,
    (_P.FORWARDING, "forward_failed"): _P.FORWARD_FAILED,
    (_P.FORWARD_FAILED, "reforward"): _P.FORWARDING,
    (_P.ANSWERED, "evict"): _P.EVICTED,
    (_P.FORWARD_FAILED, "evict"): _P.EVICTED,
}
# A request holds the record: a retransmission joins it.
IN_FLIGHT = frozenset({_P.RUNNING, _P.FORWARDING})
# What a record keeps between requests, counted against max_stored_bytes.
HELD = frozenset({_P.ANSWERED, _P.FORWARD_FAILED})


@dataclass(slots=True)
class ChunkRecord:
    ticket: Any  # the sequencer's Ticket
    phase: ChunkPhase = ChunkPhase.RUNNING
    stage_output: Any = None
    response: Any = None
    # A window's (it carried X-Meshnet-After, wire-2 §3.16): kept past its
    # run's end, for a sender's windows in flight.
    window: bool = False


def move(record: ChunkRecord, event: str) -> ChunkPhase | None:
    """Apply ``event`` to ``record``; return its new phase (None: forget it)."""
    try:  # one lookup, not a test and a lookup: each hashes the phase (a Python call)
        phase = TRANSITIONS[(record.phase, event)]
    except KeyError:
        raise ValueError(f"{event}() on a chunk that is {record.phase.value}") from None
    if phase is not None:
        record.phase = phase
    return phase
