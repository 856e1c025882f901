"""The gateway's view of its client sessions (wire-2 §3, "The gateway").

A client session is a context the gateway feeds down the chain on the
client's behalf: the gateway keeps its position (the offset the next request
starts at) and lets one request at a time use it. A request takes a
``Lease``; it ends with ``commit(tokens)`` (the chunks went through: the
position moves on) or ``abort()`` (a chunk failed for good: the nodes'
contexts no longer match, so the gateway forgets the session and deletes it
down the chain). Pure: no clock (``now`` is an argument), no I/O.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from enum import Enum

from ._errors import CapacityError, SequencingError

__all__ = ["ClientSessionTable", "Lease"]


class _LeaseState(Enum):
    ACTIVE = "active"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass(slots=True)
class _Entry:
    position: int
    touched: float
    busy: bool = False


class Lease:
    """One request's hold on a client session.

    ``session`` is the id to send down the chain and return to the client;
    ``position`` is the offset of the request's first token (the response's
    ``X-Meshnet-Position``); ``minted`` says the gateway made the id.
    End a lease exactly once, with ``commit`` or ``abort``.
    """

    __slots__ = ("_entry", "_state", "_table", "minted", "position", "session")

    def __init__(
        self, table: ClientSessionTable, entry: _Entry, session: str, *, minted: bool
    ) -> None:
        self._table = table
        self._entry = entry
        self._state = _LeaseState.ACTIVE
        self.session = session
        self.position = entry.position
        self.minted = minted

    def commit(self, tokens: int, now: float | None = None) -> None:
        """The request's chunks went through: advance the position by ``tokens``.

        ``commit(0)`` ends a request that sent nothing down the chain. ``now``
        restarts the idle clock (default: the time the lease began).
        """
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be a non-negative int, got {tokens!r}")
        self._close(_LeaseState.COMMITTED)
        if self._table._entries.get(self.session) is self._entry:  # not ended meanwhile
            self._entry.position += tokens
            if now is not None:
                self._entry.touched = now
            self._entry.busy = False

    def abort(self) -> None:
        """A chunk failed for good: forget the session (the client starts again)."""
        self._close(_LeaseState.ABORTED)
        if self._table._entries.get(self.session) is self._entry:
            del self._table._entries[self.session]

    def _close(self, state: _LeaseState) -> None:
        if self._state is not _LeaseState.ACTIVE:
            raise RuntimeError(f"lease of session {self.session} is already {self._state.value}")
        self._state = state

    def __repr__(self) -> str:
        return (
            f"Lease(session={self.session!r}, position={self.position}, "
            f"minted={self.minted}, state={self._state.value})"
        )


class ClientSessionTable:
    """At most ``max_sessions`` client sessions, each forgotten ``ttl`` s after
    its last use (the gateway's ``--max-sessions`` and ``--session-ttl``)."""

    def __init__(self, max_sessions: int, ttl: float) -> None:
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be a positive int, got {max_sessions!r}")
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
            raise ValueError(f"ttl must be a positive number, got {ttl!r}")
        self.max_sessions = max_sessions
        self.ttl = float(ttl)
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session: object) -> bool:
        return session in self._entries

    def position(self, session: str) -> int | None:
        entry = self._entries.get(session)
        return None if entry is None else entry.position

    def begin(self, session: str | None, now: float, *, entropy: bytes | None = None) -> Lease:
        """Start a request on ``session`` (None: make a new one).

        A new id is a canonical UUID4 made from ``entropy`` (16 random bytes
        the caller supplies, e.g. ``os.urandom(16)``) or from ``uuid.uuid4()``.
        A client session the gateway does not know (after a gateway restart,
        or made up by the client) starts at position 0; the nodes tell the
        client if their context says otherwise.
        Raises 409 ``session_busy`` if a request already holds the session,
        503 ``sessions_full`` (with ``retry_after``) if there is no room.
        """
        minted = session is None
        if session is None:
            if entropy is None:
                session = str(uuid.uuid4())
            else:
                if len(entropy) != 16:
                    raise ValueError(f"entropy must be 16 bytes, got {len(entropy)}")
                session = str(uuid.UUID(bytes=bytes(entropy), version=4))
        entry = self._entries.get(session)
        if entry is None:
            self._make_room(now)
            entry = self._entries[session] = _Entry(position=0, touched=now)
        elif entry.busy:
            raise SequencingError(
                f"session {session} already has a request in progress",
                code="session_busy",
                header="x-meshnet-session",
            )
        entry.busy = True
        entry.touched = now
        return Lease(self, entry, session, minted=minted)

    def end(self, session: str) -> bool:
        """Forget a session (the client's DELETE); True if it was known.

        A request still holding it finishes, but its commit no longer
        brings the session back.
        """
        return self._entries.pop(session, None) is not None

    def expire(self, now: float) -> list[str]:
        """Forget sessions unused for longer than ``ttl`` (not those in use)."""
        expired = [
            sid for sid, e in self._entries.items() if not e.busy and now - e.touched > self.ttl
        ]
        for sid in expired:
            del self._entries[sid]
        return expired

    def _make_room(self, now: float) -> None:
        if len(self._entries) < self.max_sessions:
            return
        self.expire(now)
        if len(self._entries) < self.max_sessions:
            return
        soonest = min(
            self.ttl if e.busy else e.touched + self.ttl - now for e in self._entries.values()
        )
        raise CapacityError(
            f"the gateway holds {len(self._entries)} client sessions, its maximum",
            code="sessions_full",
            retry_after=max(1, math.ceil(soonest)),
        )
