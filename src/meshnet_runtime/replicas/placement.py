"""Where a replica set sends a session, and what it knows of its replicas.

The decisions of docs/failover.md, with nothing to wait on: no sockets, no
event loop, every time passed in (``now``), so a test drives them with a
fake clock. ``ReplicaState`` is one replica's record (up, down with its
backoff, retired, taken out for another stage); ``Placement`` holds the
records, the sessions' stickiness and the pinned fingerprint, and answers
which replica a chunk goes to, what a probe's outcome changes and which
replicas may be dropped. The monitor (``monitor.py``) and the driver
(``replica_set.py``) act on its answers.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..bounded import BoundedLRU
from ..endpoints import Endpoint

__all__ = [
    "MAX_BACKOFF",
    "Placement",
    "ReplicaState",
    "Route",
    "address_url",
    "is_name",
    "needs_replica_set",
]

log = logging.getLogger("meshnet.replicas")

# A down replica is probed again after interval * 2^failures, at most this.
MAX_BACKOFF = 30.0
# Block keys a replica set remembers the holder of (a key and a reference each).
MAX_PREFIX_KEYS = 65536


def is_name(endpoint: Endpoint) -> bool:
    """The URL's host is a DNS name (not an address, not a Unix socket)."""
    if endpoint.scheme == "unix" or not endpoint.host:
        return False
    try:
        ipaddress.ip_address(endpoint.host.strip("[]"))
    except ValueError:
        return True
    return False


def needs_replica_set(endpoints: Sequence[Endpoint]) -> bool:
    """Several URLs, or one whose host is a DNS name other than localhost."""
    if len(endpoints) > 1:
        return True
    return bool(endpoints) and is_name(endpoints[0]) and endpoints[0].host != "localhost"


def address_url(endpoint: Endpoint, address: str) -> str:
    """The URL of one address a name of ``endpoint`` resolved to."""
    host = f"[{address}]" if ":" in address else address
    return f"{endpoint.scheme}://{host}:{endpoint.port}"


@dataclass(eq=False, slots=True)
class ReplicaState:
    """What a replica set knows of one replica (compared by identity)."""

    url: str
    source: str  # the configured URL it came from (a name's addresses share one)
    up: bool = True
    inflight: int = 0
    failures: int = 0
    next_probe: float = 0.0
    retired: bool = False  # its address left the DNS answer: no new sessions
    probe_misses: int = 0  # probes in a row that went unanswered
    # What it serves (its /info identity's fingerprint), read when it first
    # answers and again whenever it comes back: a restart may bring another stage.
    fingerprint: str | None = None
    identity_read: bool = False
    instance: str | None = None  # the process its /health names: another one is a restart
    mismatch: bool = False  # not the stage the set pinned: never chosen
    # What its /info handoff object says it takes (wire-2 §3.12): prefill,
    # decode or any; read with the identity.
    kv_role: str = "any"
    # It answered 503 shutting_down (a forward or a probe): still there for
    # a while, so its sessions move by their KV, not by replay (wire-2 §3.11).
    draining: bool = False

    def mark_down(self, now: float, interval: float) -> None:
        """Down: probed again after ``interval * 2**(failures - 1)``, at most ``MAX_BACKOFF``."""
        if self.up:
            log.warning("replica %s is down", self.url)
        self.up = False
        self.failures += 1
        self.next_probe = now + min(interval * 2 ** (self.failures - 1), MAX_BACKOFF)

    def mark_up(self) -> None:
        if not self.up:
            log.info("replica %s is up again", self.url)
        self.up = True
        self.failures = 0
        self.draining = False


R = TypeVar("R", bound=ReplicaState)


@dataclass(frozen=True, slots=True)
class Route(Generic[R]):
    """Where a session's chunk goes: to ``replica``, or (``recover``) the
    session moves first, away from ``replica`` (None: it is stuck nowhere).

    ``alive`` (with ``recover``): ``replica`` failed no forward (only its
    probes fail, or it holds another state): it stays a last resort."""

    replica: R | None
    recover: bool = False
    alive: bool = False


class Placement(Generic[R]):
    """The replicas of one hop, which one each session sticks to, and the
    stage they must serve (the first fingerprint one showed).

    ``version`` is bumped on every change of membership or state (down, up,
    joined, retired, taken out) and ``on_change`` hears of each."""

    def __init__(self, interval: float, on_change: Callable[[], None] | None = None) -> None:
        self.interval = interval  # the health interval: the backoff's unit
        self.on_change = on_change
        self.version = 0
        self.replicas: list[R] = []
        self.sticky: dict[str, R] = {}
        self.pinned: str | None = None
        # The prefix cache (wire-2 §3.10): which replica filed each block key
        # it was sent (bounded, oldest first out), so a session that starts
        # after a cached prefix goes where that prefix is.
        self.prefixes: BoundedLRU[str, R] = BoundedLRU(MAX_PREFIX_KEYS)
        self.prefix_placed = 0  # new sessions sent to their prefix's holder

    def changed(self) -> None:
        self.version += 1
        if self.on_change is not None:
            self.on_change()

    # ------------------------------------------------------------ choice

    def ranked(self, exclude: Sequence[R] = (), *, fallback: bool = True) -> list[R]:
        """Healthy replicas, fewest in flight (then fewest sessions) first.

        With none healthy, the down ones not excluded, fewest failures first:
        a probe that timed out on a loaded machine marks a slow replica down,
        and trying it beats failing the session for sure. Each one that
        fails for real joins ``exclude``, so a caller's loop ends."""
        load = self.session_counts()
        usable = [r for r in self.replicas if not r.mismatch]  # never another stage
        live = [r for r in usable if r.up and not r.retired and r not in exclude]
        if not live and fallback:
            rest = [r for r in usable if r not in exclude]
            return sorted(rest, key=lambda r: (r.retired, r.failures, r.inflight))
        return sorted(live, key=lambda r: (r.inflight, load.get(r.url, 0)))

    def any_order(self) -> list[R]:
        """For a request any replica may answer: the ranked ones, else every
        one of this stage."""
        return self.ranked() or [r for r in self.replicas if not r.mismatch]

    def session_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for replica in self.sticky.values():
            counts[replica.url] = counts.get(replica.url, 0) + 1
        return counts

    def holder(self, session: str) -> str | None:
        """The URL of the replica a session sticks to."""
        replica = self.sticky.get(session)
        return replica.url if replica is not None else None

    def filed(self, replica: R, keys: Sequence[str]) -> None:
        """``replica`` answered a chunk that filed ``keys`` (or attached one)."""
        for key in keys:
            self.prefixes[key] = replica

    def route(self, session: str, first: bool, prefix: str | None = None) -> Route[R] | None:
        """Where a chunk of ``session`` goes (``first``: it starts the
        session); None when it starts one and no replica is left at all.

        A new session sticks to the best ranked replica — the one holding
        ``prefix`` (the cached prefix it starts after) when that one is
        healthy; if it has evicted it since, it answers 409 ``prefix_unknown``
        and the sender starts over cold, placed by load. One stuck to a
        replica of another stage, or to one only its probes call down while
        a healthy one is left, moves; with none healthy, it is sent where it
        is (a probe can time out on a slow but healthy replica)."""
        replica = self.sticky.get(session)
        fresh = replica is None and first
        if fresh:
            ranked = self.ranked()
            if not ranked:
                return None
            # wire-2 §3.12: prompts go to the prefill replicas (and "any"), when one is up.
            prompts = [r for r in ranked if r.kv_role != "decode"]
            if prompts and any(r.kv_role == "decode" for r in ranked):
                ranked = prompts
            holder = self.prefixes.get(prefix) if prefix is not None else None
            if holder is not None and holder in ranked and holder.up:
                self.prefix_placed += 1
                ranked = [holder]
            replica = self.sticky[session] = ranked[0]
        if replica is None:
            return Route(None, recover=True)
        if replica.mismatch:  # it came back as another stage: its state is not this session's
            return Route(replica, recover=True)
        if not (replica.up or fresh) and self.ranked(exclude=[replica], fallback=False):
            return Route(replica, recover=True, alive=True)
        return Route(replica)

    def moved(self, session: str, failed: R | None) -> R | None:
        """The replica another chunk of the session moved it to meanwhile,
        if it is still fit: nothing to rebuild."""
        current = self.sticky.get(session)
        if current is not None and current is not failed and current.up and not current.mismatch:
            return current
        return None

    # ------------------------------------------------------------ health

    def mark_down(self, replica: R, now: float) -> None:
        was_up = replica.up
        replica.mark_down(now, self.interval)
        if was_up:
            self.changed()

    def due(self, now: float) -> list[R]:
        """The replicas to probe now: the up ones, and the down ones whose backoff ended."""
        return [r for r in self.replicas if r.up or now >= r.next_probe]

    def probe_failed(self, replica: R, now: float, *, unanswered: bool) -> None:
        """Refused or reset: down at once. Unanswered: down at the second
        miss in a row (one slow answer on a loaded machine is not a hang)."""
        replica.probe_misses += 1
        if not unanswered or replica.probe_misses >= 2 or not replica.up:
            self.mark_down(replica, now)

    def probe_answered(self, replica: R, instance: str | None) -> bool:
        """A probe's answer: True when the replica's identity must be read
        (again) before it is used: it is new, back up, or another process."""
        replica.probe_misses = 0
        restarted = instance != replica.instance and replica.instance is not None
        replica.instance = instance
        if not replica.up or not replica.identity_read or restarted:
            replica.identity_read = False
            return True
        return False

    def back_up(self, replica: R) -> None:
        if not replica.up:
            replica.mark_up()
            self.changed()

    def pin(self, replica: R, fingerprint: str | None) -> None:
        """The replica's identity was read: the first fingerprint seen is
        pinned, and one showing another is taken out (back when it shows
        the pinned one again). None (a node too old to say): nothing to pin."""
        replica.identity_read = True
        if fingerprint is None:
            return
        replica.fingerprint = fingerprint
        if self.pinned is None:
            self.pinned = fingerprint
        mismatch = fingerprint != self.pinned
        if mismatch != replica.mismatch:
            replica.mismatch = mismatch
            if mismatch:
                log.error(
                    "replica %s serves another stage (fingerprint %s, this hop's is %s): "
                    "taken out of service",
                    replica.url,
                    fingerprint,
                    self.pinned,
                )
            else:
                log.info("replica %s serves this hop's stage again", replica.url)
            self.changed()

    # ------------------------------------------------------------ membership

    def add(self, replica: R) -> R:
        self.replicas.append(replica)
        return replica

    def resolved(self, source: str, urls: set[str]) -> list[str]:
        """A name (``source``) now resolves to ``urls``: its replicas not
        among them retire, those among them come back; the new URLs, to add."""
        for replica in self.replicas:
            if replica.source == source:
                retired = replica.url not in urls
                if retired != replica.retired:
                    replica.retired = retired
                    self.changed()
        known = {r.url for r in self.replicas}
        return sorted(urls - known)

    def drop_stale(self) -> list[R]:
        """Retired replicas no session sticks to and none is sent to, removed
        (one replica is always kept): the caller closes them. Stickiness to a
        replica that is down stays (the session's next chunk fails over)."""
        held = {r.url for r in self.sticky.values()}
        dropped = []
        for replica in [r for r in self.replicas if r.retired and r.url not in held]:
            if replica.inflight == 0 and len(self.replicas) > 1:
                self.replicas.remove(replica)
                dropped.append(replica)
        return dropped
