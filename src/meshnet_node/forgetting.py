"""A session forgotten while one of its chunks was on its way down: its
DELETE is passed down again once that chunk is answered.

The node forgets a session (DELETE, TTL, eviction) whenever the table
says so, also while one of its chunks is computing or on its way down; a
DELETE passed down then may have overtaken that chunk, which then started
the session afresh below, with a KV cache nobody would ever end but the
TTL. ``InFlight`` counts each session's chunks between admission and
answer and, when the last of a forgotten session's ends, DELETEs it below.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio

from meshnet_proto import MeshnetError
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import Downstream, key_headers

__all__ = ["ORPHAN_DELETE_TIMEOUT", "InFlight"]

log = logging.getLogger("meshnet.node")

# The DELETE passed down for a session forgotten while one of its chunks was
# on its way down: bounded, a hung downstream is left to its TTL.
ORPHAN_DELETE_TIMEOUT = 10.0


class InFlight:
    """Chunks of each session between admission and their answer, and the
    sessions forgotten meanwhile.

    ``known(session)`` says whether the node knows the session again (started
    anew meanwhile: nothing is passed down then).
    """

    def __init__(self, downstream: Downstream | None, known: Callable[[str], bool]) -> None:
        self.downstream = downstream
        self.known = known
        # A plain dict, not a Counter: its Python-level __missing__ and
        # __delitem__ were ~1.5 us of every decode step (section decode).
        self._busy: dict[str, int] = {}
        self._orphans: set[str] = set()
        # The session key of each session with a chunk in flight: the DELETE
        # passed down for an orphan must carry it (wire-2 §3.9).
        self._keys: dict[str, str | None] = {}

    @property
    def count(self) -> int:
        """Chunks admitted and not yet answered, over every session."""
        return sum(self._busy.values())

    def started(self, session: str, key: str | None) -> None:
        """A chunk of ``session`` was admitted (it carried ``key``)."""
        busy = self._busy
        busy[session] = busy.get(session, 0) + 1
        self._keys[session] = key

    def forgotten(self, session: str) -> None:
        """The node forgot ``session``: an orphan if a chunk of it is in flight."""
        if self._busy.get(session):
            self._orphans.add(session)

    def ended(self, session: str) -> tuple[str, str | None] | None:
        """A chunk of ``session`` was answered (or failed, or was cancelled).

        When it was the last in flight of a forgotten session: that session
        and its key, for ``pass_forget_down``; else None (a decode step's
        usual end: no coroutine at all, section decode)."""
        left = self._busy[session] - 1
        if left > 0:
            self._busy[session] = left
            return None
        del self._busy[session]
        key = self._keys.pop(session, None)
        if session in self._orphans:
            self._orphans.discard(session)
            return session, key
        return None

    async def pass_forget_down(self, session: str, key: str | None = None) -> None:
        """DELETE a session below us again after a chunk of it went down.

        Shielded and bounded: this runs in the ``finally`` of a request that
        may be cancelled (its client left).
        """
        if self.downstream is None or self.known(session):
            return  # last stage, or the session was started again meanwhile
        with anyio.CancelScope(shield=True):
            try:
                await self.downstream.request(
                    "DELETE",
                    f"/sessions/{session}",
                    Deadline.after(ORPHAN_DELETE_TIMEOUT),
                    key_headers(key),
                )
            except MeshnetError as exc:
                log.warning("could not pass the end of session %s down: %s", session, exc)
