"""What one hop sent downstream, per session: the material of a replay.

A hop that fails a session over to another replica must bring that replica
to the state the dead one had, without asking anything upstream to compute
again (docs/failover.md). So each hop keeps, per session, every chunk it
sent downstream and saw answered: the wire headers and the encoded body, as
sent. A replay sends them again, in the order they ran, to the new replica.

That order is the position order within a session's line (its *epoch*: the
rewinds it has had, wire-2 §3.16), line after line. Positions alone do not
order a session that speculates: after a rewind it comes back to positions
it held before, with other tokens, and the windows a rewind took back
(stale, at positions past it) ran before it. They stay in the history: the
rewind follows the position they left (its ``X-Meshnet-After``), so a
replica rebuilt by a replay must run them too, then take them back, to
reach the same position and epoch. A chunk without ``X-Meshnet-After`` is in
the latest line the hop has seen of its session.

Bounded: ``max_bytes`` over all sessions (bodies plus a fixed cost per
chunk). Past it the least recently used sessions lose their whole history
(a partial history could not rebuild anything) and are remembered as
*evicted*, so a failover of one of them fails with a clear error instead of
replaying a gap. The evicted set is itself bounded.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from meshnet_proto import WireHeaders

from .bounded import BoundedLRU

__all__ = ["CHUNK_OVERHEAD", "HistoryStore", "Order", "SentChunk"]

# What a kept chunk costs besides its body: headers and bookkeeping.
CHUNK_OVERHEAD = 512
# How many evicted session ids are remembered (oldest forgotten first).
_EVICTED_REMEMBERED = 65536


Order = tuple[int, int]  # (epoch, position): where a chunk ran in its session


@dataclass(frozen=True, slots=True)
class SentChunk:
    headers: WireHeaders  # as sent, without the deadline
    body: bytes | bytearray | memoryview
    epoch: int = 0  # the session's line it ran in (wire-2 §3.16)

    @property
    def cost(self) -> int:
        # A grammar's mask (wire-2 §3.13) rides in the headers: up to 2 MiB.
        sample = self.headers.sample
        mask = 0 if sample is None or sample.allow is None else len(sample.allow)
        return memoryview(self.body).nbytes + CHUNK_OVERHEAD + mask

    @property
    def order(self) -> Order:
        return (self.epoch, self.headers.position or 0)

    @property
    def key(self) -> tuple[int, int, int]:
        return (*self.order, self.headers.chunk_index or 0)


@dataclass(slots=True)
class _Session:
    chunks: dict[tuple[int, int, int], SentChunk] = field(default_factory=dict)
    nbytes: int = 0
    touched: float = 0.0
    epoch: int = 0  # the latest line seen (a chunk without After is in it)


class HistoryStore:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._evicted: BoundedLRU[str, None] = BoundedLRU(_EVICTED_REMEMBERED)

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session: str) -> bool:
        return session in self._sessions

    def add(
        self,
        session: str,
        headers: WireHeaders,
        body: bytes | bytearray | memoryview,
        now: float = 0.0,
    ) -> None:
        """Keep one chunk sent (and answered); the same chunk again replaces itself."""
        if session in self._evicted:
            return  # its history has a gap: keeping the rest could not rebuild it
        entry = self._sessions.get(session)
        if entry is None:
            entry = self._sessions[session] = _Session()
        epoch = entry.epoch if headers.after is None else headers.after.epoch
        entry.epoch = max(entry.epoch, epoch)
        chunk = SentChunk(headers.replace(deadline_ms=None), body, epoch)
        self._sessions.move_to_end(session)
        entry.touched = now
        old = entry.chunks.pop(chunk.key, None)
        if old is not None:
            entry.nbytes -= old.cost
            self.nbytes -= old.cost
        entry.chunks[chunk.key] = chunk
        entry.nbytes += chunk.cost
        self.nbytes += chunk.cost
        while self.nbytes > self.max_bytes and self._sessions:
            oldest, dropped = self._sessions.popitem(last=False)
            self.nbytes -= dropped.nbytes
            self._remember_evicted(oldest)

    def order_of(self, session: str, headers: WireHeaders) -> Order:
        """Where a chunk of ``session`` with ``headers`` falls in its order."""
        entry = self._sessions.get(session)
        latest = 0 if entry is None else entry.epoch
        epoch = latest if headers.after is None else headers.after.epoch
        return (epoch, headers.position or 0)

    def chunks(self, session: str, before: Order | None = None) -> list[SentChunk]:
        """The session's chunks in the order they ran; with ``before`` (see
        ``order_of``), only those that ran before it (the chunk being failed
        over is not part of its own replay)."""
        entry = self._sessions.get(session)
        if entry is None:
            return []
        kept = sorted(entry.chunks.values(), key=lambda c: c.key)
        if before is None:
            return kept
        return [c for c in kept if c.order < before]

    def evicted(self, session: str) -> bool:
        return session in self._evicted

    def forget(self, session: str) -> None:
        """The session ended: its history and any eviction mark go."""
        entry = self._sessions.pop(session, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
        self._evicted.pop(session, None)

    def expire(self, now: float, ttl: float) -> list[str]:
        """Forget sessions not added to for ``ttl`` (the nodes below forgot them too)."""
        idle = [s for s, e in self._sessions.items() if now - e.touched > ttl]
        for session in idle:
            self.forget(session)
        return idle

    def sessions(self) -> list[str]:
        return list(self._sessions)

    def _remember_evicted(self, session: str) -> None:
        self._evicted[session] = None
