"""wire-2 §3 — sessions and chunk sequencing — as a pure state machine.

``SessionTable`` decides, for every chunk a node receives, whether its stage
runs now, waits for a predecessor, answers from what is stored, or is refused.
It never blocks and never reads a clock: every method takes ``now`` and
returns a decision; the driver does the waiting, the running and the I/O.
The driver's side of the contract is in ``docs/core-api.md`` (*The SessionTable contract*).

Per session it keeps the position (tokens taken in), the run in progress
(its total, dtype and trailing shape, the next index to run), one record per
chunk that ran — bounded to the reorder window, see ``_runs.trim`` — for the
current run and the last finished run, when a chunk last left the stage
(the waiters' reorder timer, see ``_waiting``), and the waiters. Nothing grows
with the length of a run or the age of a session.

The table composes its parts: ``_claims`` (what headers may claim),
``_routing`` (where a chunk falls), ``_runs`` (the records of a session's
runs), ``_waiting`` (waits and their timer), ``_capacity`` (session quotas
and expiry), ``_replay_store`` and ``_waiters``; the values it returns are in
``_decisions``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from ._capacity import Capacity
from ._chunk_record import ChunkRecord, move
from ._claims import check_claims, check_owner, require, unknown
from ._decisions import Decision, Join, Process, Reforward, Replay, Ticket, Wait
from ._errors import ErrorCode, SequencingError
from ._fingerprint import tensor_fingerprint
from ._limits import Limits
from ._replay_store import ReplayStore
from ._rewinds import admit, check_unknown_after
from ._rewinds import route_any as route_chunk
from ._routing import Headers, Route, Session, check_window, run_shape
from ._runs import again, all_records, keep_window, lookup, trim
from ._waiters import Waiter, WaiterRegistry
from ._waiting import Waiting

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
        self._window = self.limits.reorder_window
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
        # The collaborators: session quotas and expiry; waits and their timer.
        self._capacity = Capacity(self.limits, self._sessions, self._waiters, self._drop)
        self._waiting = Waiting(
            self.limits,
            max_pending_waiters,
            self._sessions,
            self._waiters,
            self._left_stage,
            self._serials,
        )

    # -- queries ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session: object) -> bool:
        return session in self._sessions

    def position(self, session: str) -> int | None:
        """Tokens the session has taken in, or None if this node does not know it."""
        s = self._sessions.get(session)
        return None if s is None else s.position

    def epoch(self, session: str) -> int | None:
        """The rewinds the session has had (wire-2 §3.16), or None if this
        node does not know it."""
        s = self._sessions.get(session)
        return None if s is None else s.epoch

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
        sid, index, _ = require(headers)
        s = self._sessions.get(sid)
        check_claims(s, sid, index, headers, replay)
        if s is None:
            route = self._route_unknown(sid, index, headers, now, client)
        else:
            route, _ = route_chunk(self._window, s, headers, None)
        if route is Route.AHEAD:
            self._waiting.check_room(sid, index)

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
        sid, index, _ = require(headers)
        if waiter is not None:
            if (waiter.session, waiter.index) != (sid, index):
                raise ValueError("offer(): waiter belongs to another chunk")
            if not self._waiters.remove(waiter, known=sid in self._sessions):
                raise unknown(f"session {sid}: ended or expired while chunk {index} waited")
        s = self._sessions.get(sid)
        check_claims(s, sid, index, headers, replay)
        record: ChunkRecord | None = None
        if s is None:
            route = self._route_unknown(sid, index, headers, now, client)
        else:
            s.touched = now
            route, record = route_chunk(self._window, s, headers, fingerprint)
        if route is Route.AHEAD:
            return self._waiting.wait(sid, index, now, waiter, deadline)
        if route is Route.AGAIN:
            assert record is not None
            return again(record, self._store)
        if s is None:
            s = self._create(sid, now, headers.session_key, client)
            if headers.prefix is not None:  # wire-2 §3.10: it starts after a cached prefix
                s.position = headers.position or 0
        return self._process(s, headers, fingerprint)

    def give_up(self, waiter: Waiter, now: float) -> SequencingError:
        """The driver abandons the wait (it was cancelled): forget the waiter
        and return the error to answer. A wait that runs out ends in ``offer``."""
        if not self._waiters.remove(waiter, known=waiter.session in self._sessions):
            return unknown(
                f"session {waiter.session}: ended or expired while chunk {waiter.index} waited"
            )
        return self._waiting.over(waiter, now)

    # -- a ticket's outcome --------------------------------------------------------

    def stage_done(self, ticket: Ticket, stage_output: Any, now: float) -> None:
        """The stage ran: the session moves on; wake this session's waiters.

        ``stage_output`` is kept until ``response_ready`` so that a failed
        forward can be retried without running the stage twice.
        """
        found = lookup(self._sessions, ticket)
        if found is None:
            return  # the session ended meanwhile; nothing to advance
        s, record = found
        move(record, "stage_done")
        record.stage_output = stage_output
        s.touched = now
        self._left_stage[s.id] = now
        # Not += tokens: a rewind ran below the session's position (wire-2 §3.16).
        s.position = ticket.position + ticket.tokens
        s.epoch = ticket.epoch
        s.next_index += 1
        assert s.shape is not None
        if s.next_index == s.shape.total:  # run finished: the next chunk is a new run's 0
            s.last_records, s.last_total = s.records, s.shape.total
            s.records, s.shape, s.next_index = {}, None, 0
            s.run += 1
        trim(s, self._window, self._store)

    def stage_failed(self, ticket: Ticket, now: float) -> None:
        """The stage raised: nothing advances; a retransmission may run it again."""
        found = lookup(self._sessions, ticket)
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
        found = lookup(self._sessions, ticket)
        if found is None:
            return
        s, record = found
        self._store.answered(record, response, nbytes)
        s.touched = now
        trim(s, self._window, self._store)

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
        found = lookup(self._sessions, ticket)
        if found is None:
            return
        s, record = found
        self._store.forward_failed(record, nbytes)
        s.touched = now
        trim(s, self._window, self._store)

    # -- a KV hand-off (wire-2 §3.11) ---------------------------------------------------

    def check_adopt(self, session: str, now: float, *, client: str | None = None) -> None:
        """What a KV import's head needs of the table (wire-2 §3.11 step 4):
        the session is not held here (409 ``session_exists``: an import never
        rewrites a live session) and there is room for one more (§3.6, §3.9)."""
        if session in self._sessions:
            raise SequencingError(
                f"session {session} is live here: a KV import cannot replace it (DELETE it first)",
                code=ErrorCode.SESSION_EXISTS,
                header="x-meshnet-session",
            )
        self._capacity.check_client_room(client, now)
        self._capacity.make_room(now)

    def between_runs(self, session: str, now: float) -> bool:
        """The session is held here with no run open and no chunk in flight
        or waiting: its state is final, so it may be exported (wire-2 §3.11)."""
        s = self._sessions.get(session)
        return s is not None and s.shape is None and not self._capacity.busy(s, now)

    def adopt(
        self,
        session: str,
        position: int,
        now: float,
        *,
        key: str | None = None,
        client: str | None = None,
        epoch: int = 0,
    ) -> None:
        """Hold ``session`` from here on, between runs at ``position``, epoch
        ``epoch`` (§3.16): its state came in a KV import (wire-2 §3.11). Bound
        to ``key`` as a first chunk binds it (§3.9). The checks of
        ``check_adopt`` run again: the table may have changed meanwhile."""
        self.check_adopt(session, now, client=client)
        s = self._create(session, now, key, client)
        s.position, s.epoch = position, epoch

    # -- ending ----------------------------------------------------------------------

    def check_owner(self, session: str, key: str | None) -> None:
        """Raise 403 ``session_forbidden`` unless ``key`` may end (or use)
        ``session`` here (wire-2 §3.9); a session this table does not hold
        passes (its DELETE is a 404 or is passed down)."""
        s = self._sessions.get(session)
        if s is not None:
            check_owner(s, key)

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
        return self._capacity.expire(now)

    # -- routing -----------------------------------------------------------------------

    def _route_unknown(
        self, sid: str, index: int, headers: Headers, now: float, client: str | None
    ) -> Route:
        check_unknown_after(sid, headers)  # wire-2 §3.16: only line 0 starts here
        if index == 0:
            position = headers.position
            # wire-2 §3: never silently start a context anywhere but at 0 —
            # or after the cached prefix the chunk names (§3.10), which the
            # stage attaches or refuses (409 prefix_unknown).
            if position and headers.prefix is None:
                raise unknown(
                    f"session {sid} is unknown here, so chunk 0 cannot start at position "
                    f"{position} (expired, deleted, or this node restarted)"
                )
            self._capacity.check_client_room(client, now)
            self._capacity.make_room(now)
            return Route.TURN
        check_window(self._window, sid, index, 0)
        # Its chunk 0 would be refused: say so now rather than after a wait.
        self._capacity.make_room(now)
        return Route.AHEAD

    # -- bookkeeping ---------------------------------------------------------------------------

    def _process(self, s: Session, h: Headers, fp: bytes) -> Process:
        if s.shape is None:  # chunk 0 opens a run; the last run's records go (wire-2 §3)
            s.shape = run_shape(h)
            self._store.forget(keep_window(s))
            s.last_records = {}
        assert h.chunk_index is not None
        ticket = admit(s, h, fp, next(self._serials))  # a rewind runs below S (§3.16)
        s.records[ticket.index] = ChunkRecord(ticket, window=h.after is not None)
        return Process(ticket)

    def _create(self, sid: str, now: float, key: str | None, client: str | None) -> Session:
        s = self._sessions[sid] = Session(sid, touched=now, key=key, client=client)
        self._capacity.charge(client, sid)
        self._waiters.session_started(sid)
        return s

    def _drop(self, sid: str) -> None:
        s = self._sessions.pop(sid, None)
        self._left_stage.pop(sid, None)
        self._waiters.drop(sid, known=s is not None)
        if s is not None:
            self._capacity.discharge(s.client, sid)
            self._store.forget(all_records(s))
            if self._on_forget is not None:
                self._on_forget(sid)
