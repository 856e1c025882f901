"""Where a chunk that carries ``X-Meshnet-After`` falls (wire-2 §3.16).

Such a chunk is a run's chunk 0 that follows its session once the session
holds ``F`` tokens in its ``E``-th line (its epoch: the rewinds it has had).
At its own position ``p = F`` it is a plain successor; at ``p < F`` a
rewind, which drops the session's positions ``[p, F)`` and opens line
``E = e + 1``. It is routed by the session's position ``S``, epoch ``e``
and open run, instead of wire-2 §3.2 steps 4 to 7:

1. ``E < e``: a window of a line the session rewound away from: 409
   ``window_stale``, at once.
2. ``E = e`` and ``p < F``: the rewind that opened line ``e``, again: a
   retransmission.
3. ``E > e + 1``, or ``E = e + 1`` with ``p = F``: it waits for the chunks
   before it (the rewind of its line has not run here yet).
4. Otherwise it waits while a run is open or ``S < F``; with ``S > F`` it is
   a retransmission or 409 ``position_mismatch``; with ``S = F`` it runs.

A retransmission is found by its record: chunk 0 of the open run (or of the
last run, between runs) that ran at ``p``, in line ``E``, as a rewind from
``F`` or not as the chunk is. So a retransmission of a chunk still in the
stage joins it, as any chunk's does. Pure functions; ``SessionTable`` acts
on the verdict as it does on ``_routing``'s.
"""

from __future__ import annotations

from ._chunk_record import ChunkRecord
from ._decisions import Ticket, new_ticket
from ._errors import ErrorCode, SequencingError
from ._routing import Headers, Route, Session, conflict, route
from ._windows import AfterSpec, check_after_place

__all__ = ["admit", "check_unknown_after", "route_any"]

_AFTER = "x-meshnet-after"


def route_any(
    window: int, s: Session, h: Headers, fp: bytes | None
) -> tuple[Route, ChunkRecord | None]:
    """``_routing.route`` for a chunk without ``X-Meshnet-After`` (wire-2
    §3.2, whatever the session's epoch); §3.16's rules for one with it."""
    after = h.after
    if after is None:
        return route(window, s, h, fp)
    check_after_place(after, h.chunk_index, h.position)  # headers built by hand
    assert h.position is not None
    return _route_after(s, h, h.position, after, fp)


def _route_after(
    s: Session, h: Headers, p: int, after: AfterSpec, fp: bytes | None
) -> tuple[Route, ChunkRecord | None]:
    first, line, epoch = after.position, after.epoch, s.epoch
    if line < epoch:
        raise SequencingError(
            f"session {s.id}: this chunk follows epoch {line}, but the session was rewound "
            f"to epoch {epoch}: the window is stale",
            code=ErrorCode.WINDOW_STALE,
            header=_AFTER,
        )
    found = _its_record(s, p, after)
    if found is not None:
        return _again(s, h, *found, fp)
    rewind = p < first
    if line == epoch and rewind:
        raise SequencingError(
            f"session {s.id}: the rewind that opened epoch {epoch} has run here, and this "
            "chunk is not it as kept (another tensor, or it is kept no more)",
            code=ErrorCode.CHUNK_CONFLICT,
            header=_AFTER,
        )
    if line > epoch + 1 or (line == epoch + 1 and not rewind):
        return Route.AHEAD, None  # its line's rewind has not run here yet
    if s.shape is not None or s.position < first:
        return Route.AHEAD, None  # the chunks before it have not all run yet
    if s.position > first:
        raise SequencingError(
            f"session {s.id}: the session holds {s.position} tokens, this chunk follows {first}",
            code=ErrorCode.POSITION_MISMATCH,
            header="x-meshnet-position",
        )
    return Route.TURN, None


def _its_record(s: Session, p: int, after: AfterSpec) -> tuple[ChunkRecord, int] | None:
    """The record of this very chunk, if it ran (or runs) here, and its
    run's total: chunk 0 of the open run (or of the last run, between
    runs), or of an earlier window's run; at ``p`` in the chunk's line, a
    rewind from ``F`` exactly when the chunk is one."""
    rewind_from = after.position if p < after.position else None
    wanted = (p, after.epoch, rewind_from)
    latest = (s.records if s.shape is not None else s.last_records).get(0)
    total = s.shape.total if s.shape is not None else s.last_total
    # An earlier window's run had one chunk.
    found = [(latest, total), *((r, 1) for r in reversed(s.earlier))]
    for record, its_total in found:
        if record is None:
            continue
        ticket = record.ticket
        if (ticket.position, ticket.epoch, ticket.rewind_from) == wanted:
            return record, its_total
    return None


def _again(
    s: Session, h: Headers, record: ChunkRecord, total: int, fp: bytes | None
) -> tuple[Route, ChunkRecord | None]:
    # The kept answer names its run's total: another total is another chunk.
    if h.chunk_total != total or (fp is not None and fp != record.ticket.fingerprint):
        raise conflict(s, 0)
    if fp is None:
        return Route.UNDECIDED, None
    return Route.AGAIN, record


def check_unknown_after(sid: str, h: Headers) -> None:
    """A chunk with ``X-Meshnet-After`` may start a session this node does
    not hold only as its first chunk would (line 0, ``p = F``): a rewind, or
    a successor in a later line, follows a context this node does not have."""
    after = h.after
    if after is None:
        return
    check_after_place(after, h.chunk_index, h.position)  # headers built by hand
    assert h.position is not None
    if after.epoch > 0 or h.position < after.position:
        raise SequencingError(
            f"session {sid} is unknown here, so a chunk that follows position "
            f"{after.position} in epoch {after.epoch} cannot start it",
            code=ErrorCode.SESSION_UNKNOWN,
            header="x-meshnet-session",
        )


def admit(s: Session, h: Headers, fp: bytes, serial: int) -> Ticket:
    """The ticket of a chunk admitted to run: where it runs (a rewind at its
    own position, below the session's), the session's epoch once it ran,
    and for a rewind the position ``F`` it drops back from."""
    assert h.chunk_index is not None
    after = h.after
    position, epoch, rewind_from = s.position, s.epoch, None
    if after is not None:
        assert h.position is not None  # checked with the header (check_after_place)
        epoch = after.epoch
        if h.position < after.position:
            position, rewind_from = h.position, after.position
    return new_ticket(
        s.id,
        s.run,
        h.chunk_index,
        position,
        h.tokens,
        fp,
        serial,
        epoch=epoch,
        rewind_from=rewind_from,
    )
