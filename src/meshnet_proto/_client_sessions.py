"""The gateway's view of its client sessions (wire-2 §3, "The gateway").

A client session is a context the gateway feeds down the chain on the
client's behalf: the gateway keeps its position (the offset the next request
starts at) and lets one request at a time use it. A request takes a
``Lease``; it ends with ``commit(tokens)`` (the chunks went through: the
position moves on) or ``abort()`` (a chunk failed for good: the nodes'
contexts no longer match, so the gateway forgets the session and deletes it
down the chain). Pure: no clock (``now`` is an argument), no I/O.

Ownership (wire-2 §3.9): each client session is bound to a key — the
client's, or one minted here and returned once in the answer that created
it — and every later request on it must carry that key. The nodes' copy of
the session is bound to another key, the session's ``node_key``, minted here
and never shown to the client.
"""

from __future__ import annotations

import hmac
import math
import secrets
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from ._errors import CapacityError, ErrorCode, ProtocolError, SequencingError

__all__ = ["ClientSessionTable", "Lease"]


class _LeaseState(Enum):
    ACTIVE = "active"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass(slots=True)
class _Entry:
    position: int
    touched: float
    key: str
    node_key: str
    client: str | None = None
    busy: bool = False


class Lease:
    """One request's hold on a client session.

    ``session`` is the id to send down the chain and return to the client;
    ``position`` is the offset of the request's first token (the response's
    ``X-Meshnet-Position``); ``minted`` says the gateway made the id.
    ``key`` is the session's client-facing key, ``key_minted`` whether the
    gateway made it (then the answer carries it, that once); ``node_key`` is
    the key to send down the chain.
    End a lease exactly once, with ``commit`` or ``abort``.
    """

    __slots__ = (
        "_entry",
        "_state",
        "_table",
        "key",
        "key_minted",
        "minted",
        "node_key",
        "position",
        "session",
    )

    def __init__(
        self,
        table: ClientSessionTable,
        entry: _Entry,
        session: str,
        *,
        minted: bool,
        key_minted: bool = False,
    ) -> None:
        self._table = table
        self._entry = entry
        self._state = _LeaseState.ACTIVE
        self.session = session
        self.position = entry.position
        self.minted = minted
        self.key = entry.key
        self.node_key = entry.node_key
        self.key_minted = key_minted

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
            self._table.end(self.session)

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
    its last use (the gateway's ``--max-sessions`` and ``--session-ttl``), and
    at most ``max_per_client`` of them created by one client (default
    ``max_sessions // 2``; 0: no quota)."""

    def __init__(self, max_sessions: int, ttl: float, *, max_per_client: int | None = None) -> None:
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be a positive int, got {max_sessions!r}")
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
            raise ValueError(f"ttl must be a positive number, got {ttl!r}")
        if max_per_client is None:
            max_per_client = max_sessions // 2
        if (
            isinstance(max_per_client, bool)
            or not isinstance(max_per_client, int)
            or (max_per_client < 0)
        ):
            raise ValueError(f"max_per_client must be a non-negative int, got {max_per_client!r}")
        self.max_sessions = max_sessions
        self.max_per_client = max_per_client
        self.ttl = float(ttl)
        self._entries: dict[str, _Entry] = {}
        self._by_client: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session: object) -> bool:
        return session in self._entries

    def position(self, session: str) -> int | None:
        entry = self._entries.get(session)
        return None if entry is None else entry.position

    def node_key(self, session: str) -> str | None:
        """The key the chain's copy of ``session`` is bound to (None: not held)."""
        entry = self._entries.get(session)
        return None if entry is None else entry.node_key

    def check_owner(self, session: str, key: str | None) -> None:
        """403 ``session_forbidden`` unless ``key`` is ``session``'s (a session
        not held here passes: its DELETE is a 404 or the chain's business)."""
        entry = self._entries.get(session)
        if entry is not None:
            _check_key(session, entry.key, key)

    def begin(
        self,
        session: str | None,
        now: float,
        *,
        entropy: bytes | None = None,
        key: str | None = None,
        client: str | None = None,
        key_entropy: bytes | None = None,
    ) -> Lease:
        """Start a request on ``session`` (None: make a new one).

        A new id is a canonical UUID4 made from ``entropy`` (16 random bytes
        the caller supplies, e.g. ``os.urandom(16)``) or from ``uuid.uuid4()``.
        A client session the gateway does not know (after a gateway restart,
        or made up by the client) starts at position 0; the nodes tell the
        client if their context says otherwise.
        ``key`` is the request's session key: a session created here is
        bound to it, or, without one, to a key minted from the first 16 bytes
        of ``key_entropy`` (32 random bytes; default ``secrets``); the last 16
        make its ``node_key``. ``client`` (the peer, opaque) is charged for a
        session this creates.
        Raises 403 ``session_forbidden`` for a key that is not the session's,
        409 ``session_busy`` if a request already holds the session,
        429 ``client_sessions_full`` / 503 ``sessions_full`` (with
        ``retry_after``) if there is no room.
        """
        if key_entropy is not None and len(key_entropy) != 32:
            raise ValueError(f"key_entropy must be 32 bytes, got {len(key_entropy)}")
        minted = session is None
        if session is None:
            if entropy is None:
                session = str(uuid.uuid4())
            else:
                if len(entropy) != 16:
                    raise ValueError(f"entropy must be 16 bytes, got {len(entropy)}")
                session = str(uuid.UUID(bytes=bytes(entropy), version=4))
        entry = self._entries.get(session)
        key_minted = False
        if entry is None:
            self._make_room(now, client)
            raw = secrets.token_bytes(32) if key_entropy is None else bytes(key_entropy)
            key_minted = key is None
            entry = self._entries[session] = _Entry(
                position=0,
                touched=now,
                key=raw[:16].hex() if key is None else key,
                node_key=raw[16:].hex(),
                client=client,
            )
            if client is not None:
                self._by_client.setdefault(client, set()).add(session)
        else:
            _check_key(session, entry.key, key)
        if entry.busy:
            raise SequencingError(
                f"session {session} already has a request in progress",
                code=ErrorCode.SESSION_BUSY,
                header="x-meshnet-session",
            )
        entry.busy = True
        entry.touched = now
        return Lease(self, entry, session, minted=minted, key_minted=key_minted)

    def end(self, session: str) -> bool:
        """Forget a session (the client's DELETE); True if it was known.

        A request still holding it finishes, but its commit no longer
        brings the session back.
        """
        entry = self._entries.pop(session, None)
        if entry is None:
            return False
        if entry.client is not None:
            mine = self._by_client[entry.client]
            mine.discard(session)
            if not mine:
                del self._by_client[entry.client]
        return True

    def expire(self, now: float) -> list[str]:
        """Forget sessions unused for longer than ``ttl`` (not those in use)."""
        expired = [
            sid for sid, e in self._entries.items() if not e.busy and now - e.touched > self.ttl
        ]
        for sid in expired:
            self.end(sid)
        return expired

    def _make_room(self, now: float, client: str | None) -> None:
        mine = self._by_client.get(client) if client is not None else None
        if mine is not None and self.max_per_client and len(mine) >= self.max_per_client:
            self.expire(now)
            if len(mine) >= self.max_per_client:
                raise CapacityError(
                    f"this client holds {len(mine)} sessions at the gateway, its maximum",
                    code=ErrorCode.CLIENT_SESSIONS_FULL,
                    retry_after=self._soonest(now, mine),
                )
        if len(self._entries) < self.max_sessions:
            return
        self.expire(now)
        if len(self._entries) < self.max_sessions:
            return
        raise CapacityError(
            f"the gateway holds {len(self._entries)} client sessions, its maximum",
            code=ErrorCode.SESSIONS_FULL,
            retry_after=self._soonest(now, self._entries),
        )

    def _soonest(self, now: float, sessions: Iterable[str]) -> int:
        """Retry-After: seconds until the soonest of ``sessions`` expires (>= 1)."""
        soonest = min(
            self.ttl if e.busy else e.touched + self.ttl - now
            for e in (self._entries[sid] for sid in sessions)
        )
        return max(1, math.ceil(soonest))


def _check_key(session: str, bound: str, key: str | None) -> None:
    """wire-2 §3.9 at the gateway: constant-time, never showing a key."""
    if key is None or not hmac.compare_digest(bound, key):
        why = "carries no session key" if key is None else "carries another session key"
        raise ProtocolError(
            f"session {session} is bound to a session key; this request {why}",
            code=ErrorCode.SESSION_FORBIDDEN,
            header="x-meshnet-session-key",
        )
