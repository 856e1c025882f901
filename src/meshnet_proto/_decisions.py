"""What ``SessionTable`` hands its driver for a chunk (wire-2 §3): the
ticket of an admitted run and the five decisions ``offer`` returns.

Plain frozen values, apart from the table so that a driver's type hints
and a test's fakes need not import the state machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

from ._slots import slot_setters
from ._waiters import Waiter

__all__ = ["Ticket", "Process", "Wait", "Replay", "Reforward", "Join", "Decision"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Ticket:
    """One admitted run of a chunk's stage; hand it back to report its outcome.

    ``position`` is where the chunk starts in the session (the node's count,
    also when the sender sent none). ``serial`` is unique per table, so a
    ticket of an ended session never touches a new session of the same id.

    wire-2 §3.16: ``rewind_from`` is ``F`` when the chunk is a rewind (its
    stage drops positions ``[position, F)`` of the session before it runs
    the chunk), else None; ``epoch`` is the session's epoch once the stage
    has run the chunk (a rewind's is one more than the session's before it).
    """

    session: str
    run: int
    index: int
    position: int
    tokens: int
    fingerprint: bytes
    serial: int
    rewind_from: int | None = None
    epoch: int = 0


_FIELDS = ("session", "run", "index", "position", "tokens", "fingerprint", "serial")
_SETTERS = slot_setters(Ticket, (*_FIELDS, "rewind_from", "epoch"))


def new_ticket(
    session: str,
    run: int,
    index: int,
    position: int,
    tokens: int,
    fingerprint: bytes,
    serial: int,
    *,
    epoch: int = 0,
    rewind_from: int | None = None,
) -> Ticket:
    """The table's own `Ticket` of values it holds: equal to constructing it,
    its slots set directly past the frozen keyword ``__init__`` (one a chunk)."""
    ticket = object.__new__(Ticket)
    values = (session, run, index, position, tokens, fingerprint, serial, rewind_from, epoch)
    for set_slot, value in zip(_SETTERS, values, strict=True):
        set_slot(ticket, value)
    return ticket


@dataclass(frozen=True, slots=True)
class Process:
    """Run the stage on this chunk now, then report through the ticket."""

    ticket: Ticket


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait for a wake-up of this session or ``until``, then offer again with
    ``waiter``: that offer decides whether the wait is over (wire-2 §3.3)."""

    waiter: Waiter
    until: float


@dataclass(frozen=True, slots=True)
class Replay:
    """An identical retransmission of an answered chunk: send this response."""

    response: Any


@dataclass(frozen=True, slots=True)
class Reforward:
    """An identical retransmission of a chunk whose forward failed: forward
    ``stage_output`` again and report through ``ticket`` as after ``stage_done``."""

    ticket: Ticket
    stage_output: Any


@dataclass(frozen=True, slots=True)
class Join:
    """An identical retransmission of a chunk still in flight: answer with the
    outcome of the request that holds ``ticket``."""

    ticket: Ticket


Decision: TypeAlias = Process | Wait | Replay | Reforward | Join
