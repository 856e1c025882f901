"""wire-2 §3 — sessions and chunk sequencing — as a pure state machine.

``SessionTable`` decides, for every chunk a node receives, whether its stage
runs now, waits for a predecessor, answers from what is stored, or is refused.
It never blocks and never reads a clock: every method takes ``now`` and
returns a decision; the driver does the waiting, the running and the I/O.
The driver's side of the contract is in ``docs/sessions.md``.

Per session it keeps the position (tokens taken in), the run in progress
(its total, dtype and trailing shape, the next index to run), one record per
chunk that ran — bounded to the reorder window, see ``_trim`` — for the
current run and the last finished run, when a chunk last left the stage
(the waiters' reorder timer, see ``_until``), and the waiters. Nothing grows with
the length of a run or the age of a session.
"""

from __future__ import annotations

import hmac
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

import numpy as np
import xxhash

from ._chunk_record import IN_FLIGHT, ChunkPhase, ChunkRecord, move
from ._errors import CapacityError, ProtocolError, SequencingError
from ._limits import Limits
from ._replay_store import ReplayStore
from ._routing import Headers, Route, Session, check_window, run_shape
from ._routing import route as route_chunk
from ._waiters import Waiter, WaiterRegistry

# How long a full table's "no room" verdict is reused (SessionTable._make_room).
_RESCAN_SECONDS = 1.0

__all__ = [
    "SessionTable",
    "Ticket",
    "Waiter",
    "Process",
    "Wait",
    "Replay",
    "Reforward",
    "Join",
    "Decision",
    "tensor_fingerprint",
]

_SESSION = "x-meshnet-session"
_INDEX = "x-meshnet-chunk-index"
_TOTAL = "x-meshnet-chunk-total"
_POSITION = "x-meshnet-position"
_KEY = "x-meshnet-session-key"


def tensor_fingerprint(array: np.ndarray) -> bytes:
    """A 16-byte XXH3-128 digest of a tensor's shape, dtype name and bytes.

    Two chunks are "the same tensor" (wire-2 §3 replay) when their decoded
    values are: the wire encoding does not matter, so the bytes hashed are the
    little-endian C-order element bytes, whatever the array's memory layout.

    Every chunk is fingerprinted on its request's critical path, so speed
    matters: XXH3 runs at ~18 GB/s against BLAKE2b's ~0.8 GB/s here (0.9 ms
    against 21 ms for a 16 MiB chunk). It is not collision-resistant against
    an adversary, and it need not be: a crafted collision only makes the
    crafter's own retransmission get the stored answer of the chunk it sent
    before, in a session it already writes to — nothing another peer relies on.
    """
    arr = np.asarray(array)
    little = arr.dtype.newbyteorder("<")
    if arr.dtype != little:  # the wire is little-endian; the same values hash the same
        arr = arr.astype(little)
    arr = np.ascontiguousarray(arr)
    # "|" appears in neither a shape nor a dtype name, so the framing is
    # unambiguous. One update for the framing (a decode step hashes 16 KiB:
    # per-call overhead is most of its cost).
    digest = xxhash.xxh3_128(
        b"meshnet-tensor|%b|%b|"
        % (",".join(map(str, arr.shape)).encode("ascii"), arr.dtype.name.encode("ascii"))
    )
    digest.update(arr.reshape(-1).view(np.uint8).data)
    return digest.digest()


@dataclass(frozen=True, slots=True, kw_only=True)
class Ticket:
    """One admitted run of a chunk's stage; hand it back to report its outcome.

    ``position`` is where the chunk starts in the session (the node's count,
    also when the sender sent none). ``serial`` is unique per table, so a
    ticket of an ended session never touches a new session of the same id.
    """

    session: str
    run: int
    index: int
    position: int
    tokens: int
    fingerprint: bytes
    serial: int


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


def _require(h: Headers) -> tuple[str, int, int]:
    """A node needs the sequencing headers (the gateway's input may lack them)."""
    for value, header in ((h.session, _SESSION), (h.chunk_index, _INDEX), (h.chunk_total, _TOTAL)):
        if value is None:
            raise ProtocolError(f"{header} is required", code="missing_header", header=header)
    assert h.session is not None and h.chunk_index is not None and h.chunk_total is not None
    if h.chunk_index >= h.chunk_total:
        raise ProtocolError(
            f"chunk index {h.chunk_index} is not below chunk total {h.chunk_total}",
            code="bad_chunk_index",
            header=_INDEX,
        )
    return h.session, h.chunk_index, h.chunk_total


def _check_owner(s: Session, key: str | None) -> None:
    """wire-2 §3.9: a keyed session is its key holder's; an unkeyed one stays
    unkeyed. Constant-time, and the message never shows a key."""
    if s.key is None and key is None:
        return
    if s.key is None:
        why = "was created without a key; a key cannot be added later"
    elif key is None:
        why = "is bound to a session key and this request carries none"
    elif hmac.compare_digest(s.key, key):
        return
    else:
        why = "is bound to another session key"
    raise ProtocolError(f"session {s.id} {why}", code="session_forbidden", status=403, header=_KEY)


def _check_claims(s: Session | None, sid: str, index: int, h: Headers, replay: bool) -> None:
    """What a chunk may claim about a session before it is routed (wire-2 §3.9):
    its owner's key; a replay never restarts a live session; only a session's
    very first chunk may leave its position to the node."""
    if s is not None:
        _check_owner(s, h.session_key)
        if replay and index == 0 and not h.position:
            raise SequencingError(
                f"session {sid} is live here: a replay cannot start it again "
                "(DELETE it first to rebuild it)",
                code="session_exists",
                header=_SESSION,
            )
    if h.position is None and (index > 0 or s is not None):
        raise SequencingError(
            f"session {sid}: chunk {index} carries no position; only the first chunk of a "
            "new session may omit it",
            code="position_required",
            header=_POSITION,
        )


def _unknown(message: str) -> SequencingError:
    return SequencingError(message, code="session_unknown", header=_SESSION)


def _in_stage(s: Session) -> bool:
    """Whether a chunk of the session is in the stage (admitted, not yet done
    or failed): only its next index can be, and a record there is RUNNING —
    ``stage_done`` moves the next index on, ``stage_failed`` drops the record."""
    return s.next_index in s.records


class SessionTable:
    """The sessions of one node and the order of their chunks (wire-2 §3).

    ``max_pending_waiters`` bounds the chunks waiting for sessions this node
    does not know yet (their chunk 0 has not run); the default,
    ``4 * reorder_window``, lets four sessions start out of order at once with
    a full window each, and refuses a flood of chunks for sessions that never
    start instead of holding their bodies.

    ``on_forget(session)`` is called whenever a known session is forgotten —
    ``end_session``, ``expire``, and the expiry that makes room for a new
    session inside ``check_head``/``offer`` — so that state kept beside the
    table (a model stage's KV cache) goes with it. It must not call back into
    the table.
    """

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        max_pending_waiters: int | None = None,
        on_forget: Callable[[str], None] | None = None,
    ):
        self.limits = Limits() if limits is None else limits
        if max_pending_waiters is None:
            max_pending_waiters = 4 * self.limits.reorder_window
        if max_pending_waiters < 1:
            raise ValueError("max_pending_waiters must be positive")
        self.max_pending_waiters = max_pending_waiters
        self._on_forget = on_forget
        self._sessions: dict[str, Session] = {}
        # Waiters of known and not-yet-known sessions alike, so that creating
        # a session needs no move.
        self._waiters = WaiterRegistry()
        self._serials = itertools.count(1)
        # Answers and outputs kept for retransmissions, held to max_stored_bytes.
        self._store = ReplayStore(self.limits.max_stored_bytes)
        # When a chunk of each known session last left the stage (done or
        # failed): a waiter's reorder timer counts from then (wire-2 §3.3).
        self._left_stage: dict[str, float] = {}
        # The sessions each client created (the per-client quota, wire-2 §3.9).
        self._by_client: dict[str, set[str]] = {}
        # _make_room's last verdict on a full table (see there).
        self._full_rescan_at = -math.inf
        self._full_soonest_at = -math.inf

    # -- queries ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session: object) -> bool:
        return session in self._sessions

    def position(self, session: str) -> int | None:
        """Tokens the session has taken in, or None if this node does not know it."""
        s = self._sessions.get(session)
        return None if s is None else s.position

    # -- a request's chunk -------------------------------------------------------

    def check_head(
        self, headers: Headers, now: float, *, replay: bool = False, client: str | None = None
    ) -> None:
        """The checks that need only the headers (wire-2 §2 order: before the body).

        Raises what ``offer`` would raise for these headers whatever the
        tensor; ``offer`` repeats every check, since the table may have changed
        while the body was read. May expire idle sessions to make room.
        ``replay`` and ``client`` are as for ``offer``.
        """
        sid, index, _ = _require(headers)
        s = self._sessions.get(sid)
        _check_claims(s, sid, index, headers, replay)
        if s is None:
            route = self._route_unknown(sid, index, headers.position, now, client)
        else:
            route, _ = route_chunk(self.limits.reorder_window, s, headers, None)
        if route is Route.AHEAD:
            self._check_room_to_wait(sid, index)

    def offer(
        self,
        headers: Headers,
        fingerprint: bytes,
        now: float,
        *,
        waiter: Waiter | None = None,
        deadline: float | None = None,
        replay: bool = False,
        client: str | None = None,
    ) -> Decision:
        """Decide what to do with a decoded chunk (see the decision classes).

        ``waiter`` is the one from an earlier ``Wait`` for this same request;
        ``deadline`` (absolute, same clock as ``now``) is where a new wait
        ends at the latest. Raises ``SequencingError`` (409) — also
        ``chunk_wait_timeout`` for a waiter whose time is up, see ``_until`` —
        ``CapacityError`` (503) or, for headers missing the sequencing fields,
        ``ProtocolError`` (400).

        wire-2 §3.9: ``headers.session_key`` must be the session's (403
        ``session_forbidden``); a new session is bound to it. ``replay`` says
        the request is a replay (``?replay=1``), which cannot start a session
        this table holds (409 ``session_exists``). ``client`` (opaque: the
        driver's name for the peer) is charged for a session this creates,
        at most ``limits.max_sessions_per_client`` (429 ``client_sessions_full``).
        """
        sid, index, _ = _require(headers)
        if waiter is not None:
            if (waiter.session, waiter.index) != (sid, index):
                raise ValueError("offer(): waiter belongs to another chunk")
            if not self._waiters.remove(waiter, known=sid in self._sessions):
                raise _unknown(f"session {sid}: ended or expired while chunk {index} waited")
        s = self._sessions.get(sid)
        _check_claims(s, sid, index, headers, replay)
        record: ChunkRecord | None = None
        if s is None:
            route = self._route_unknown(sid, index, headers.position, now, client)
        else:
            s.touched = now
            route, record = route_chunk(self.limits.reorder_window, s, headers, fingerprint)
        if route is Route.AHEAD:
            return self._wait(sid, index, now, waiter, deadline)
        if route is Route.AGAIN:
            assert record is not None
            return self._again(record)
        if s is None:
            s = self._create(sid, now, headers.session_key, client)
        return self._process(s, headers, fingerprint)

    def give_up(self, waiter: Waiter, now: float) -> SequencingError:
        """The driver abandons the wait (it was cancelled): forget the waiter
        and return the error to answer. A wait that runs out ends in ``offer``."""
        if not self._waiters.remove(waiter, known=waiter.session in self._sessions):
            return _unknown(
                f"session {waiter.session}: ended or expired while chunk {waiter.index} waited"
            )
        return self._wait_over(waiter, now)

    # -- a ticket's outcome --------------------------------------------------------

    def stage_done(self, ticket: Ticket, stage_output: Any, now: float) -> None:
        """The stage ran: the session moves on; wake this session's waiters.

        ``stage_output`` is kept until ``response_ready`` so that a failed
        forward can be retried without running the stage twice.
        """
        found = self._lookup(ticket)
        if found is None:
            return  # the session ended meanwhile; nothing to advance
        s, record = found
        move(record, "stage_done")
        record.stage_output = stage_output
        s.touched = now
        self._left_stage[s.id] = now
        s.position += ticket.tokens
        s.next_index += 1
        assert s.shape is not None
        if s.next_index == s.shape.total:  # run finished: the next chunk is a new run's 0
            s.last_records, s.last_total = s.records, s.shape.total
            s.records, s.shape, s.next_index = {}, None, 0
            s.run += 1
        self._trim(s)

    def stage_failed(self, ticket: Ticket, now: float) -> None:
        """The stage raised: nothing advances; a retransmission may run it again."""
        found = self._lookup(ticket)
        if found is None:
            return
        s, record = found
        move(record, "stage_failed")
        del s.records[ticket.index]
        if ticket.index == 0:  # the run never started after all
            s.shape = None
        s.touched = now
        # Not progress, but the time it spent in the stage was no stall: the
        # retransmission a sender owes gets a whole reorder timeout.
        self._left_stage[s.id] = now

    def response_ready(self, ticket: Ticket, response: Any, now: float, *, nbytes: int = 0) -> None:
        """Keep a success response for replay; the stage output is no longer needed.

        ``nbytes`` is the response's size as the driver counts it; stored
        responses together are held to ``limits.max_stored_bytes``: past it
        the oldest go, and a retransmission of theirs is refused (409).
        """
        found = self._lookup(ticket)
        if found is None:
            return
        s, record = found
        self._store.answered(record, response, nbytes)
        s.touched = now
        self._trim(s)

    @property
    def stored_bytes(self) -> int:
        """Bytes still held between requests: stored responses and stage outputs
        kept for a reforward (as ``response_ready``/``forward_failed`` were told)."""
        return self._store.stored_bytes

    def forward_failed(self, ticket: Ticket, now: float, *, nbytes: int = 0) -> None:
        """The forward failed: keep the stage output so a retransmission reforwards it.

        ``nbytes`` (the output's size) counts against ``limits.max_stored_bytes``
        like a stored response: past the budget the oldest held bytes go, and a
        retransmission of theirs is refused (409) — its stage already ran.
        """
        found = self._lookup(ticket)
        if found is None:
            return
        s, record = found
        self._store.forward_failed(record, nbytes)
        s.touched = now
        self._trim(s)

    # -- ending ----------------------------------------------------------------------

    def check_owner(self, session: str, key: str | None) -> None:
        """Raise 403 ``session_forbidden`` unless ``key`` may end (or use)
        ``session`` here (wire-2 §3.9); a session this table does not hold
        passes (its DELETE is a 404 or is passed down)."""
        s = self._sessions.get(session)
        if s is not None:
            _check_owner(s, key)

    def end_session(self, session: str) -> bool:
        """Forget a session (DELETE); its waiters' next offer raises session_unknown.

        Returns whether this node knew it. Waiters for a session that never
        started are dropped too: the sender gave up on that context.
        """
        known = session in self._sessions
        self._drop(session)
        return known

    def expire(self, now: float) -> list[str]:
        """Forget sessions idle longer than ``limits.session_ttl``; return their ids.

        A session with a chunk in flight, or with a waiter whose time is not up,
        is not idle.
        """
        ttl = self.limits.session_ttl
        expired = [
            sid
            for sid, s in self._sessions.items()
            if now - s.touched > ttl and not self._busy(s, now)
        ]
        for sid in expired:
            self._drop(sid)
        return expired

    # -- routing -----------------------------------------------------------------------

    def _route_unknown(
        self, sid: str, index: int, position: int | None, now: float, client: str | None
    ) -> Route:
        if index == 0:
            if position:  # wire-2 §3: never silently start a context anywhere but at 0
                raise _unknown(
                    f"session {sid} is unknown here, so chunk 0 cannot start at position "
                    f"{position} (expired, deleted, or this node restarted)"
                )
            self._check_client_room(client, now)
            self._make_room(now)
            return Route.TURN
        check_window(self.limits.reorder_window, sid, index, 0)
        # Its chunk 0 would be refused: say so now rather than after a wait.
        self._make_room(now)
        return Route.AHEAD

    # -- decisions -------------------------------------------------------------------------

    def _process(self, s: Session, h: Headers, fp: bytes) -> Process:
        if s.shape is None:  # chunk 0 opens a run; the last run's records go (wire-2 §3)
            s.shape = run_shape(h)
            self._store.forget(s.last_records.values())
            s.last_records = {}
        assert h.chunk_index is not None
        ticket = Ticket(
            session=s.id,
            run=s.run,
            index=h.chunk_index,
            position=s.position,
            tokens=h.tokens,
            fingerprint=fp,
            serial=next(self._serials),
        )
        s.records[ticket.index] = ChunkRecord(ticket)
        return Process(ticket)

    def _again(self, record: ChunkRecord) -> Decision:
        if record.phase in IN_FLIGHT:
            return Join(record.ticket)
        if record.phase is ChunkPhase.ANSWERED:
            return Replay(record.response)
        if record.phase is ChunkPhase.EVICTED:
            raise SequencingError(
                f"session {record.ticket.session}: chunk {record.ticket.index} already ran, "
                "but its answer or output is no longer kept (the node's stored-bytes budget)",
                code="chunk_conflict",
                header=_INDEX,
            )
        return Reforward(record.ticket, self._store.reforward(record))

    def _wait(
        self, sid: str, index: int, now: float, waiter: Waiter | None, deadline: float | None
    ) -> Wait:
        if waiter is None:  # a new waiter; a returning one was counted already
            self._check_room_to_wait(sid, index)
            if deadline is None:
                # The core allows no deadline (a node always has one, its
                # --timeout); a wait must still end, progress or not: a
                # session whose short runs keep finishing while this chunk's
                # turn never comes would otherwise hold it for ever.
                limits = self.limits
                deadline = now + max(limits.session_ttl, limits.reorder_timeout)
            waiter = Waiter(
                session=sid,
                index=index,
                since=now,
                until=deadline,
                end=deadline,
                serial=next(self._serials),
            )
        until = self._until(waiter)
        if now >= until:
            raise self._wait_over(waiter, now)
        waiter = replace(waiter, until=until)
        self._waiters.add(waiter, known=sid in self._sessions)
        return Wait(waiter, until)

    def _until(self, waiter: Waiter) -> float:
        """When the wait is over unless the session progresses first (wire-2 §3.3).

        The reorder timeout is there to find a predecessor lost on its way;
        while a chunk of the session is in the stage (computing, or queued
        behind other sessions' work) none is lost, so the timer stops and only
        ``end`` bounds the wait. Otherwise it runs from the later of the wait's
        start and the last time a chunk of the session left the stage. A pure
        function of the table: a waiter woken for nothing gets the same
        ``until`` again, and one offered at ``until`` sees any change it was
        not woken for (an admission, say) — so the driver need not wake
        waiters when a chunk is admitted.
        """
        s = self._sessions.get(waiter.session)
        if s is not None and _in_stage(s):
            return waiter.end
        return min(self._stall_start(waiter) + self.limits.reorder_timeout, waiter.end)

    def _stall_start(self, waiter: Waiter) -> float:
        return max(waiter.since, self._left_stage.get(waiter.session, waiter.since))

    def _wait_over(self, waiter: Waiter, now: float) -> SequencingError:
        """The error for a wait that ended at ``now`` (its waiter already forgotten)."""
        s = self._sessions.get(waiter.session)
        waited = f"{now - waiter.since:.3g} s"
        if s is None:
            return _unknown(
                f"session {waiter.session} never started: chunk {waiter.index} "
                f"waited {waited} for chunk 0"
            )
        if now >= waiter.end:
            why = "until its deadline"
        elif _in_stage(s):  # only a driver that gives up early gets here
            why = f"while chunk {s.next_index} was in the stage"
        else:
            why = f"the last {now - self._stall_start(waiter):.3g} s without progress"
        return SequencingError(
            f"session {waiter.session}: chunk {waiter.index} waited {waited} "
            f"for chunk {s.next_index}, {why}",
            code="chunk_wait_timeout",
            header=_INDEX,
        )

    def _check_room_to_wait(self, sid: str, index: int) -> None:
        window = self.limits.reorder_window
        if self._waiters.count(sid) >= window:
            raise SequencingError(
                f"session {sid}: chunk {index} cannot wait, {window} chunks already wait "
                f"(the reorder window)",
                code="chunk_out_of_window",
                header=_INDEX,
            )
        pending = self._waiters.pending
        if sid not in self._sessions and pending >= self.max_pending_waiters:
            # Load, not a sequencing fault: such waits end within the reorder timeout.
            raise CapacityError(
                f"{pending} chunks already wait for sessions that have not started",
                code="sessions_full",
                retry_after=math.ceil(self.limits.reorder_timeout),
            )

    # -- bookkeeping ---------------------------------------------------------------------------

    def _create(self, sid: str, now: float, key: str | None, client: str | None) -> Session:
        s = self._sessions[sid] = Session(sid, touched=now, key=key, client=client)
        if client is not None:
            self._by_client.setdefault(client, set()).add(sid)
        self._waiters.session_started(sid)
        return s

    def _drop(self, sid: str) -> None:
        s = self._sessions.pop(sid, None)
        self._left_stage.pop(sid, None)
        self._waiters.drop(sid, known=s is not None)
        if s is not None:
            if s.client is not None:
                mine = self._by_client[s.client]
                mine.discard(sid)
                if not mine:
                    del self._by_client[s.client]
            self._store.forget(itertools.chain(s.records.values(), s.last_records.values()))
            if self._on_forget is not None:
                self._on_forget(sid)

    def _make_room(self, now: float) -> None:
        if len(self._sessions) < self.limits.max_sessions:
            return
        # A full table's scan visits every session: done for each refused
        # request, a flood of new sessions would buy O(max_sessions) work per
        # request (issue 5). Until the soonest expiry the last scan found, no
        # idle session can expire (touching only moves expiry later); only a
        # busy session turning idle can, so the verdict is reused for at most
        # _RESCAN_SECONDS, less than the Retry-After (>= 1 s) a client gets.
        if now < self._full_rescan_at:
            raise self._full(self._full_soonest_at - now)
        self.expire(now)
        if len(self._sessions) < self.limits.max_sessions:
            return
        ttl = self.limits.session_ttl
        # The soonest an idle session expires; a busy one is counted as just touched.
        soonest = min(
            ttl if self._busy(s, now) else s.touched + ttl - now for s in self._sessions.values()
        )
        self._full_soonest_at = now + soonest
        self._full_rescan_at = now + min(soonest, _RESCAN_SECONDS)
        raise self._full(soonest)

    def _check_client_room(self, client: str | None, now: float) -> None:
        """The per-client quota (wire-2 §3.9). Over it, the client's own idle
        sessions past their TTL go first; the work is bounded by the quota,
        not by the table."""
        quota = self.limits.max_sessions_per_client or 0  # an int once Limits is built
        mine = self._by_client.get(client) if client is not None and quota else None
        if mine is None or len(mine) < quota:
            return
        ttl = self.limits.session_ttl
        sessions = [self._sessions[sid] for sid in mine]
        for s in sessions:
            if now - s.touched > ttl and not self._busy(s, now):
                self._drop(s.id)
        if len(mine) < quota:
            return
        soonest = min(
            ttl if self._busy(s, now) else s.touched + ttl - now
            for s in sessions
            if s.id in self._sessions
        )
        raise CapacityError(
            f"this client holds {len(mine)} sessions here, its maximum",
            code="client_sessions_full",
            status=429,
            retry_after=max(1, math.ceil(soonest)),
        )

    def _full(self, soonest: float) -> CapacityError:
        return CapacityError(
            f"this node holds {len(self._sessions)} sessions, its maximum",
            code="sessions_full",
            retry_after=max(1, math.ceil(soonest)),
        )

    def _busy(self, s: Session, now: float) -> bool:
        if self._waiters.waiting_at(s.id, now):
            return True
        return any(
            r.phase in IN_FLIGHT
            for r in itertools.chain(s.records.values(), s.last_records.values())
        )

    def _lookup(self, ticket: Ticket) -> tuple[Session, ChunkRecord] | None:
        s = self._sessions.get(ticket.session)
        if s is None:
            return None
        records = s.records if ticket.run == s.run else s.last_records
        record = records.get(ticket.index)
        if record is None or record.ticket.serial != ticket.serial:
            return None  # a stale ticket: its run's records were dropped
        return s, record

    def _trim(self, s: Session) -> None:
        """Keep O(window) records per run (the memory bound of docs/sessions.md).

        A sender keeps at most a window of chunks unanswered, so only those can
        come again; chunk 0 stays for the no-position replay rule; a record in
        flight stays until the driver reports its outcome.
        """
        window = self.limits.reorder_window
        for records, floor in (
            (s.records, s.next_index - window),
            (s.last_records, s.last_total - window),
        ):
            for index in [
                i for i, r in records.items() if 0 < i < floor and r.phase not in IN_FLIGHT
            ]:
                self._store.forget((records.pop(index),))
