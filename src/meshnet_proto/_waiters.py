"""The chunks that wait for their turn, by session (wire-2 §3).

A chunk ahead of its session's next index waits; the driver holds it and
offers it again when woken. The registry knows who waits where, and counts
the waiters of sessions the node does not know yet (their chunk 0 has not
run): those are bounded apart, so a flood of chunks for sessions that never
start cannot pile up. Whether a session is known is the caller's to say.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Waiter", "WaiterRegistry"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Waiter:
    """A chunk waiting for its predecessor; pass it back to ``offer``/``give_up``.

    ``since`` is when it began waiting; ``until`` when it must be offered
    again at the latest (each ``Wait`` hands back a copy with it renewed);
    ``end`` the latest its wait may last, whatever the session does (the
    request's deadline). ``serial`` names it across those copies.
    """

    session: str
    index: int
    since: float
    until: float
    end: float
    serial: int


class WaiterRegistry:
    def __init__(self) -> None:
        self._by_session: dict[str, dict[int, Waiter]] = {}
        self.pending = 0  # waiters of sessions not known (yet)

    def count(self, session: str) -> int:
        return len(self._by_session.get(session, ()))

    def waiting_at(self, session: str, now: float) -> bool:
        """Whether any of the session's waiters still has time."""
        return any(w.until > now for w in self._by_session.get(session, {}).values())

    def add(self, waiter: Waiter, *, known: bool) -> None:
        self._by_session.setdefault(waiter.session, {})[waiter.serial] = waiter
        if not known:
            self.pending += 1

    def remove(self, waiter: Waiter, *, known: bool) -> bool:
        """Forget ``waiter``; False if it was not registered (its session went)."""
        group = self._by_session.get(waiter.session)
        if group is None or group.pop(waiter.serial, None) is None:
            return False
        if not group:
            del self._by_session[waiter.session]
        if not known:
            self.pending -= 1
        return True

    def session_started(self, session: str) -> None:
        """The session became known: its waiters no longer count as pending."""
        self.pending -= self.count(session)

    def drop(self, session: str, *, known: bool) -> None:
        """The session ended: its waiters' next offer finds them gone."""
        waiters = self._by_session.pop(session, {})
        if not known:
            self.pending -= len(waiters)
