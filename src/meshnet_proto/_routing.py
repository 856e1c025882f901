"""Where a chunk falls in its session's run (wire-2 §3), from its headers alone.

A session is between runs or has one open (its total, dtype and trailing
shape fixed by chunk 0, its next index). A chunk is its run's next
(``TURN``), ahead of it (``AHEAD``: it waits), a retransmission of one that
ran (``AGAIN``: compared by fingerprint), or refused with the reason. These
are pure functions of the session and the headers; ``SessionTable`` acts on
the verdict.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from ._chunk_record import ChunkRecord
from ._errors import ErrorCode, SequencingError
from ._windows import AfterSpec

__all__ = [
    "KEPT_WINDOWS",
    "Headers",
    "Route",
    "RunShape",
    "Session",
    "check_window",
    "conflict",
    "route",
    "run_shape",
]

# Windows of one session a sender may keep in flight (wire-2 §3.16): the
# runs whose answers a node keeps for their retransmissions.
KEPT_WINDOWS = 8
_INDEX = "x-meshnet-chunk-index"
_TOTAL = "x-meshnet-chunk-total"
_POSITION = "x-meshnet-position"


class Headers(Protocol):
    """The attributes of ``WireHeaders`` the sequencer reads (duck typing)."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def session(self) -> str | None: ...
    @property
    def chunk_index(self) -> int | None: ...
    @property
    def chunk_total(self) -> int | None: ...
    @property
    def position(self) -> int | None: ...
    @property
    def tokens(self) -> int: ...
    @property
    def session_key(self) -> str | None: ...
    @property
    def prefix(self) -> str | None: ...
    @property
    def after(self) -> AfterSpec | None: ...


class Route(Enum):
    TURN = "turn"  # the chunk's turn: run its stage
    AHEAD = "ahead"  # a predecessor has not run yet: wait
    AGAIN = "again"  # identical to a chunk that ran: replay, reforward or join
    UNDECIDED = "undecided"  # needs the tensor's fingerprint (head-only check)


@dataclass(frozen=True, slots=True)
class RunShape:
    total: int
    dtype: str
    trailing: tuple[int, ...]  # the shape without the token axis (rank included)


@dataclass(slots=True)
class Session:
    id: str
    touched: float
    position: int = 0
    run: int = 0  # number of the run in progress, or of the next one between runs
    shape: RunShape | None = None  # None between runs
    next_index: int = 0
    records: dict[int, ChunkRecord] = field(default_factory=dict)
    last_records: dict[int, ChunkRecord] = field(default_factory=dict)
    last_total: int = 0
    key: str | None = None  # bound at creation (wire-2 §3.9)
    client: str | None = None  # who created it, for the per-client quota
    epoch: int = 0  # the rewinds it has had (wire-2 §3.16)
    # Chunk 0 of the single-chunk runs before the last one, newest last, at
    # most KEPT_WINDOWS: a sender keeps that many verify windows in flight,
    # so one may be sent again after later windows ran (wire-2 §3.16).
    earlier: deque[ChunkRecord] = field(default_factory=deque)


def run_shape(h: Headers) -> RunShape:
    axis = 1 if len(h.shape) >= 2 else 0  # wire-2 §2 token axis
    assert h.chunk_total is not None
    return RunShape(h.chunk_total, h.dtype, h.shape[:axis] + h.shape[axis + 1 :])


def route(
    window: int, s: Session, h: Headers, fp: bytes | None
) -> tuple[Route, ChunkRecord | None]:
    index, position = h.chunk_index, h.position
    assert index is not None
    if s.shape is not None:  # a run is open
        _check_run(s, h)
        if index > s.next_index:
            return _ahead(window, s, index, position), None
        record = s.records.get(index)
        if record is not None:  # passed, or the one running now
            return _match(s, index, position, fp, record)
        if index < s.next_index:
            raise SequencingError(
                f"session {s.id}: chunk {index} already passed and nothing of it is "
                f"kept any more (next is {s.next_index})",
                code=ErrorCode.CHUNK_CONFLICT,
                header=_INDEX,
            )
        _check_turn_position(s, position)
        return Route.TURN, None
    # Between runs: a retransmission of the last run, or the next run.
    # (A chunk of a known session always has a position: wire-2 §3.9.)
    record = s.last_records.get(index)
    if record is not None and position == record.ticket.position:
        # The stored answer names the last run's total: a "retransmission"
        # with another total is not the same chunk, and replaying would
        # hand the sender an answer for a run it did not send.
        same_total = h.chunk_total == s.last_total
        if same_total and fp is None:
            return Route.UNDECIDED, None
        if same_total and fp == record.ticket.fingerprint:
            return Route.AGAIN, record
        raise conflict(s, index)  # unmistakably the last run's chunk, changed
    if index == 0:
        _check_turn_position(s, position)
        return Route.TURN, None
    return _ahead(window, s, index, position), None


def _ahead(window: int, s: Session, index: int, position: int | None) -> Route:
    check_window(window, s.id, index, s.next_index)
    ahead = index - s.next_index
    # Every chunk has at least one token, so a position below this can never
    # match when the chunk's turn comes: refuse now instead of after a wait.
    if position is not None and position < s.position + ahead:
        raise SequencingError(
            f"session {s.id}: chunk {index} says position {position}, but it cannot "
            f"start before {s.position + ahead}",
            code=ErrorCode.POSITION_MISMATCH,
            header=_POSITION,
        )
    return Route.AHEAD


def _match(
    s: Session, index: int, position: int | None, fp: bytes | None, record: ChunkRecord
) -> tuple[Route, ChunkRecord | None]:
    if position is not None and position != record.ticket.position:
        raise SequencingError(
            f"session {s.id}: chunk {index} says position {position}, but it ran "
            f"at {record.ticket.position}",
            code=ErrorCode.POSITION_MISMATCH,
            header=_POSITION,
        )
    if fp is None:
        return Route.UNDECIDED, None
    if fp != record.ticket.fingerprint:
        raise conflict(s, index)
    return Route.AGAIN, record


def _check_turn_position(s: Session, position: int | None) -> None:
    if position is not None and position != s.position:
        raise SequencingError(
            f"session {s.id}: position is {s.position}, the chunk says {position}",
            code=ErrorCode.POSITION_MISMATCH,
            header=_POSITION,
        )


def check_window(window: int, sid: str, index: int, next_index: int) -> None:
    if index - next_index >= window:
        raise SequencingError(
            f"session {sid}: chunk {index} is beyond the reorder window "
            f"(next is {next_index}, window {window})",
            code=ErrorCode.CHUNK_OUT_OF_WINDOW,
            header=_INDEX,
        )


def _check_run(s: Session, h: Headers) -> None:
    assert s.shape is not None
    this = run_shape(h)
    for was, says, header, what in (
        (s.shape.total, this.total, _TOTAL, "chunk total"),
        (s.shape.dtype, this.dtype, "x-meshnet-dtype", "dtype"),
        (s.shape.trailing, this.trailing, "x-meshnet-shape", "shape apart from tokens"),
    ):
        if was != says:
            raise SequencingError(
                f"session {s.id}: the run started with {what} {was}, this chunk has {says}",
                code=ErrorCode.RUN_MISMATCH,
                header=header,
            )


def conflict(s: Session, index: int) -> SequencingError:
    return SequencingError(
        f"session {s.id}: chunk {index} was already sent with a different tensor or chunk total",
        code=ErrorCode.CHUNK_CONFLICT,
        header=_INDEX,
    )
