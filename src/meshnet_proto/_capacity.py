"""Which sessions a node may hold (wire-2 §3.9): the table's and each
client's maximum, idleness, and the expiry that makes room.

``Capacity`` is a collaborator of ``SessionTable``: it shares the table's
session dict and waiter registry (it reads them, never adds to them) and
forgets a session through the table's ``drop``, so that everything kept
beside a session goes with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ._chunk_record import IN_FLIGHT
from ._errors import CapacityError, ErrorCode
from ._limits import Limits
from ._routing import Session
from ._runs import all_records
from ._waiters import WaiterRegistry

__all__ = ["Capacity"]

# How long a full table's "no room" verdict is reused (Capacity.make_room).
RESCAN_SECONDS = 1.0


class Capacity:
    """The table's and the clients' session quotas, and idle expiry."""

    def __init__(
        self,
        limits: Limits,
        sessions: dict[str, Session],
        waiters: WaiterRegistry,
        drop: Callable[[str], None],
    ):
        self._limits = limits
        self._sessions = sessions
        self._waiters = waiters
        self._drop = drop
        # The sessions each client created (the per-client quota, wire-2 §3.9).
        self._by_client: dict[str, set[str]] = {}
        # make_room's last verdict on a full table (see there).
        self._full_rescan_at = -math.inf
        self._full_soonest_at = -math.inf

    def charge(self, client: str | None, sid: str) -> None:
        """``client`` created ``sid``: it counts against the client's quota."""
        if client is not None:
            self._by_client.setdefault(client, set()).add(sid)

    def discharge(self, client: str | None, sid: str) -> None:
        """``sid`` (created by ``client``) is forgotten."""
        if client is not None:
            mine = self._by_client[client]
            mine.discard(sid)
            if not mine:
                del self._by_client[client]

    def busy(self, s: Session, now: float) -> bool:
        """A chunk of the session is in flight, or waits with time left."""
        if self._waiters.waiting_at(s.id, now):
            return True
        return any(r.phase in IN_FLIGHT for r in all_records(s))

    def expire(self, now: float) -> list[str]:
        """Drop the sessions idle past ``limits.session_ttl``; return their ids."""
        ttl = self._limits.session_ttl
        expired = [
            sid
            for sid, s in self._sessions.items()
            if now - s.touched > ttl and not self.busy(s, now)
        ]
        for sid in expired:
            self._drop(sid)
        return expired

    def make_room(self, now: float) -> None:
        """Room for one more session, expiring idle ones if the table is full;
        raise 503 ``sessions_full`` if there is none."""
        if len(self._sessions) < self._limits.max_sessions:
            return
        # A full table's scan visits every session: done for each refused
        # request, a flood of new sessions would buy O(max_sessions) work per
        # request (issue 5). Until the soonest expiry the last scan found, no
        # idle session can expire (touching only moves expiry later); only a
        # busy session turning idle can, so the verdict is reused for at most
        # RESCAN_SECONDS, less than the Retry-After (>= 1 s) a client gets.
        if now < self._full_rescan_at:
            raise self._full(self._full_soonest_at - now)
        self.expire(now)
        if len(self._sessions) < self._limits.max_sessions:
            return
        ttl = self._limits.session_ttl
        # The soonest an idle session expires; a busy one is counted as just touched.
        soonest = min(
            ttl if self.busy(s, now) else s.touched + ttl - now for s in self._sessions.values()
        )
        self._full_soonest_at = now + soonest
        self._full_rescan_at = now + min(soonest, RESCAN_SECONDS)
        raise self._full(soonest)

    def check_client_room(self, client: str | None, now: float) -> None:
        """The per-client quota (wire-2 §3.9). Over it, the client's own idle
        sessions past their TTL go first; the work is bounded by the quota,
        not by the table."""
        quota = self._limits.max_sessions_per_client or 0  # an int once Limits is built
        mine = self._by_client.get(client) if client is not None and quota else None
        if mine is None or len(mine) < quota:
            return
        ttl = self._limits.session_ttl
        sessions = [self._sessions[sid] for sid in mine]
        for s in sessions:
            if now - s.touched > ttl and not self.busy(s, now):
                self._drop(s.id)
        if len(mine) < quota:
            return
        soonest = min(
            ttl if self.busy(s, now) else s.touched + ttl - now
            for s in sessions
            if s.id in self._sessions
        )
        raise CapacityError(
            f"this client holds {len(mine)} sessions here, its maximum",
            code=ErrorCode.CLIENT_SESSIONS_FULL,
            retry_after=max(1, math.ceil(soonest)),
        )

    def _full(self, soonest: float) -> CapacityError:
        return CapacityError(
            f"this node holds {len(self._sessions)} sessions, its maximum",
            code=ErrorCode.SESSIONS_FULL,
            retry_after=max(1, math.ceil(soonest)),
        )
