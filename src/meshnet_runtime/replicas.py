"""One hop served by several nodes: a replica set with failover and replay.

``ReplicaSet`` stands where a ``DownstreamPool`` stood (a node's ``--next``,
the gateway's ``--entry``) and speaks the same API (``forward``,
``request``, ``url``, ``link``, ``aclose``). Behind it, one pool per
replica. What it adds (docs/failover.md):

* **Stickiness.** A session's chunks go to one replica, the one holding its
  state; a new session (chunk 0 at position 0) goes to the healthy replica
  with the fewest requests in flight.
* **Health.** Each replica is probed (``GET /health``) every
  ``health_interval``; a probe unanswered within ``probe_timeout``, a lost
  connection or a ``503 shutting_down`` of a forward marks it down at once,
  and the forwards waiting on it are cancelled (a hung process is found by
  its probes, not by the request's deadline). A down replica is probed
  again with exponential backoff and comes back into rotation when it
  answers.
* **Failover with replay.** When the replica holding a session is down or
  says ``session_unknown`` (a restarted process), the session moves to
  another replica, which first gets the session's history at this hop
  (``history.HistoryStore``: every chunk this hop sent and saw answered)
  as ``POST /forward?replay=1``: it runs its stage and keeps the output for
  its own hop, but forwards nothing, so no stage below computes anything
  again. Then the chunk itself goes, as usual.
* **Discovery.** A hop that was itself just rebuilt by a replay does not
  know which replica below holds the session: it asks them in turn (a
  replica that does not hold it answers ``session_unknown`` from the
  header alone, before any compute) and replays only when none does.
* **DNS.** A URL whose host is a name is re-resolved every
  ``dns_interval``; each address is a replica (a Kubernetes headless
  service or a round robin is a replica set).

Deletes (``DELETE /sessions/{id}``) go to every replica, so no replica that
ever held the session keeps its state.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from meshnet_proto import (
    ActivationResponse,
    DownstreamError,
    ErrorResponse,
    Limits,
    MeshnetError,
    Response,
    WireHeaders,
)

from .deadlines import Deadline
from .downstream import DownstreamPool, key_headers
from .endpoints import Endpoint, parse_endpoint
from .history import HistoryStore, SentChunk
from .link import LinkEstimate
from .metrics import ServerMetrics

__all__ = ["REPLAY_PATH", "Replica", "ReplicaSet", "Resolver", "needs_replica_set"]

log = logging.getLogger("meshnet.replicas")

REPLAY_PATH = "/forward?replay=1"
# A down replica is probed again after interval * 2^failures, at most this.
MAX_BACKOFF = 30.0

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def _resolve(host: str, port: int) -> list[str]:
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def _is_name(endpoint: Endpoint) -> bool:
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
    return bool(endpoints) and _is_name(endpoints[0]) and endpoints[0].host != "localhost"


def _address_url(endpoint: Endpoint, address: str) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{endpoint.scheme}://{host}:{endpoint.port}"


@dataclass(eq=False, slots=True)
class Replica:
    """One node of the hop, with its own pool and probe connection."""

    url: str
    pool: DownstreamPool
    probe: DownstreamPool
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
    # Set when it goes down: forwards waiting on it stop waiting. Made on
    # first use (an anyio Event needs a running loop).
    _went_down: anyio.Event | None = None

    def went_down(self) -> anyio.Event:
        if self._went_down is None:
            self._went_down = anyio.Event()
        return self._went_down

    def mark_down(self, now: float, interval: float) -> None:
        if self.up:
            log.warning("replica %s is down", self.url)
        self.up = False
        self.failures += 1
        self.next_probe = now + min(interval * 2 ** (self.failures - 1), MAX_BACKOFF)
        self.went_down().set()

    def mark_up(self) -> None:
        if not self.up:
            log.info("replica %s is up again", self.url)
            self._went_down = None
        self.up = True
        self.failures = 0


class _Lost(Exception):
    """The replica failed (down, hung, gone): try another.

    ``hung``: no forward failed; its probes stopped answering (it may only
    be slow), so it stays a last resort."""

    def __init__(self, *, hung: bool = False) -> None:
        super().__init__()
        self.hung = hung


class ReplicaSet:
    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        *,
        limits: Limits | None = None,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        metrics: ServerMetrics | None = None,
        health_interval: float = 2.0,
        probe_timeout: float = 2.0,
        max_history_bytes: int = 256 * 1024 * 1024,
        dns_interval: float | None = None,
        resolver: Resolver | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("a replica set needs at least one URL")
        self.endpoints = tuple(endpoints)
        self.url = ",".join(e.url for e in self.endpoints)
        self.limits = limits or Limits()
        self.token = token
        self.ssl_context = ssl_context
        self.metrics = metrics
        self.health_interval = health_interval
        self.probe_timeout = probe_timeout
        self.dns_interval = dns_interval if dns_interval is not None else 10 * health_interval
        self.resolver = resolver or _resolve
        self.history = HistoryStore(max_history_bytes)
        # Bumped on every change of membership or state (down, up, joined,
        # retired, taken out); ``on_change`` hears of each (the gateway's
        # chain re-check), a cache of deep health is keyed by it.
        self.on_change = on_change
        self.version = 0
        # The fingerprint of the stage this hop serves: the first a replica
        # showed. One showing another is taken out (docs/failover.md).
        self.pinned: str | None = None
        self.replicas: list[Replica] = []
        for endpoint in self.endpoints:
            if not _is_name(endpoint) or endpoint.host == "localhost":
                self._add(endpoint.url, endpoint.url)
        self._sticky: dict[str, Replica] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self.failovers = 0
        self.replayed_chunks = 0
        self.replayed_tokens = 0
        self.replayed_bytes = 0
        self.margin = self.replicas[0].pool.margin if self.replicas else 0.1
        # --encoding auto weighs one link: the replicas' are alike enough.
        self.link = self.replicas[0].pool.link if self.replicas else LinkEstimate()
        if metrics is not None:
            metrics.registry.register(_ReplicaCollector(self))

    # ------------------------------------------------------------ membership

    def _add(self, url: str, source: str) -> Replica:
        def pool(connections: int) -> DownstreamPool:
            return DownstreamPool(
                parse_endpoint(url),
                limits=self.limits,
                token=self.token,
                ssl_context=self.ssl_context,
                max_connections=connections,
                metrics=self.metrics,
            )

        replica = Replica(url=url, pool=pool(16), probe=pool(1), source=source)
        self.replicas.append(replica)
        return replica

    async def resolve(self) -> None:
        """Re-resolve every named URL: new addresses join, vanished ones retire."""
        for endpoint in self.endpoints:
            host = endpoint.host
            # A name has a host (_is_name says False without one).
            if host is None or not _is_name(endpoint) or host == "localhost":
                continue
            try:
                addresses = await self.resolver(host, endpoint.port or 0)
            except OSError as exc:
                log.warning("cannot resolve %s: %s", host, exc)
                continue
            urls = {_address_url(endpoint, a) for a in addresses}
            for replica in self.replicas:
                if replica.source == endpoint.url:
                    retired = replica.url not in urls
                    if retired != replica.retired:
                        replica.retired = retired
                        self._changed()
            known = {r.url for r in self.replicas}
            for url in sorted(urls - known):
                log.info("replica %s joins %s", url, endpoint.url)
                self._add(url, endpoint.url)  # its /info is read at its first probe
                self._changed()

    def _changed(self) -> None:
        self.version += 1
        if self.on_change is not None:
            self.on_change()

    def _mark_down(self, replica: Replica) -> None:
        was_up = replica.up
        replica.mark_down(anyio.current_time(), self.health_interval)
        if was_up:
            self._changed()

    async def _read_identity(self, replica: Replica) -> None:
        """Read what ``replica`` serves; take it out if it is not the pinned stage."""
        try:
            response = await replica.probe.request(
                "GET", "/info", Deadline.after(self.probe_timeout)
            )
            if isinstance(response, ErrorResponse):
                raise response.to_error(hop=replica.url)
            identity = json.loads(response.body).get("identity")
            fingerprint = identity.get("fingerprint") if isinstance(identity, dict) else None
        except (MeshnetError, ValueError, AttributeError) as exc:
            # Asked again at the next probe; deep health shows why meanwhile.
            log.debug("cannot read the identity of %s: %s", replica.url, exc)
            return
        replica.identity_read = True
        if not isinstance(fingerprint, str):
            return  # a node too old to say: nothing to pin
        replica.fingerprint = fingerprint
        if self.pinned is None:
            self.pinned = fingerprint
        mismatch = fingerprint != self.pinned
        if mismatch != replica.mismatch:
            replica.mismatch = mismatch
            if mismatch:
                log.error("replica %s serves another stage (fingerprint %s, this hop's is %s): "
                          "taken out of service", replica.url, fingerprint,
                          self.pinned)  # fmt: skip
            else:
                log.info("replica %s serves this hop's stage again", replica.url)
            self._changed()

    # ------------------------------------------------------------ choice

    def _ranked(self, exclude: Sequence[Replica] = (), *, fallback: bool = True) -> list[Replica]:
        """Healthy replicas, fewest in flight (then fewest sessions) first.

        With none healthy, the down ones not excluded, fewest failures first:
        a probe that timed out on a loaded machine marks a slow replica down,
        and trying it beats failing the session for sure. Each one that
        fails for real joins ``exclude``, so a caller's loop ends."""
        load = self._session_counts()
        usable = [r for r in self.replicas if not r.mismatch]  # never another stage
        live = [r for r in usable if r.up and not r.retired and r not in exclude]
        if not live and fallback:
            rest = [r for r in usable if r not in exclude]
            return sorted(rest, key=lambda r: (r.retired, r.failures, r.inflight))
        return sorted(live, key=lambda r: (r.inflight, load.get(r.url, 0)))

    def _session_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for replica in self._sticky.values():
            counts[replica.url] = counts.get(replica.url, 0) + 1
        return counts

    def holder(self, session: str) -> str | None:
        """The URL of the replica a session sticks to (tests, /info)."""
        replica = self._sticky.get(session)
        return replica.url if replica is not None else None

    # ------------------------------------------------------------ forward

    async def forward(
        self,
        headers: WireHeaders,
        body: bytes | bytearray | memoryview,
        deadline: Deadline,
        path: str = "/forward",
    ) -> ActivationResponse | ErrorResponse:
        session = headers.session
        if session is None:  # nothing to stick to: any healthy replica
            return await self._any(lambda r: r.pool.forward(headers, body, deadline, path))
        replica = self._sticky.get(session)
        fresh = replica is None and _starts(headers)
        if fresh:
            ranked = self._ranked()
            if not ranked:
                raise self._none_left(session)
            replica = self._sticky[session] = ranked[0]
        if replica is None:
            return await self._recover(session, headers, body, deadline, None, alive=False)
        if replica.mismatch:  # it came back as another stage: its state is not this session's
            return await self._recover(session, headers, body, deadline, replica, alive=False)
        if not (replica.up or fresh) and self._ranked(exclude=[replica], fallback=False):
            # Marked down by its probes, not by a failed forward: move to a
            # healthy replica. With none, it is tried as it is (a probe can
            # time out on a slow but healthy replica).
            return await self._recover(session, headers, body, deadline, replica, alive=True)
        try:
            response = await self._attempt(replica, headers, body, deadline)
        except _Lost as lost:
            return await self._recover(session, headers, body, deadline, replica, alive=lost.hung)
        if _lost_session(response):
            return await self._recover(session, headers, body, deadline, replica, alive=True)
        self._keep(session, headers, body, response)
        moved = self._sticky.get(session)
        if moved is not None and moved is not replica and not isinstance(response, ErrorResponse):
            # Answered by the replica the session just left (a draining one
            # finishes what it has), after the move's replay was read: the
            # new replica must get this chunk too, or later ones wait for it.
            await self._catch_up(moved, session, headers, body, deadline)
        return response

    async def _catch_up(
        self,
        replica: Replica,
        session: str,
        headers: WireHeaders,
        body: bytes | bytearray | memoryview,
        deadline: Deadline,
    ) -> None:
        chunk = SentChunk(headers.replace(deadline_ms=None), body)
        async with self._locks.setdefault(session, anyio.Lock()):
            try:
                await self._replay(replica, session, [chunk], deadline)
            except (_Lost, MeshnetError) as exc:  # its next chunk fails over again
                log.warning("session %s: catching %s up failed: %r", session, replica.url, exc)

    def record_replayed(
        self, session: str, headers: WireHeaders, body: bytes | bytearray | memoryview
    ) -> None:
        """A replay rebuilt this node: keep what it would have sent, as if sent.

        The session's replica below is not known here (discovery finds it)."""
        self.history.add(session, headers, body, anyio.current_time())
        self._sticky.pop(session, None)

    def forget(self, session: str) -> None:
        """The session ended here: no history, no stickiness."""
        self.history.forget(session)
        self._sticky.pop(session, None)
        lock = self._locks.get(session)
        if lock is not None and not lock.locked():
            del self._locks[session]

    def _keep(
        self,
        session: str,
        headers: WireHeaders,
        body: bytes | bytearray | memoryview,
        response: ActivationResponse | ErrorResponse,
    ) -> None:
        if not isinstance(response, ErrorResponse):
            self.history.add(session, headers, body, anyio.current_time())

    async def _attempt(
        self,
        replica: Replica,
        headers: WireHeaders,
        body: bytes | bytearray | memoryview,
        deadline: Deadline,
        path: str = "/forward",
    ) -> ActivationResponse | ErrorResponse:
        """One forward to one replica; ``_Lost`` if it is down, hangs or goes."""
        replica.inflight += 1
        # Stop waiting when the replica goes down (its probes time out: it
        # hangs). One already down (tried as a last resort) gets two probe
        # timeouts instead.
        went_down = replica.went_down() if replica.up else None
        result: list[ActivationResponse | ErrorResponse] = []
        failure: list[BaseException] = []
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    if went_down is not None:
                        await went_down.wait()
                    else:
                        await anyio.sleep(2 * self.probe_timeout)
                    tg.cancel_scope.cancel()  # it hangs: do not wait for it

                async def send() -> None:
                    try:
                        result.append(await replica.pool.forward(headers, body, deadline, path))
                    except MeshnetError as exc:
                        failure.append(exc)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                tg.start_soon(send)
        finally:
            replica.inflight -= 1
        if failure:
            exc = failure[0]
            assert isinstance(exc, MeshnetError)
            if exc.code == "downstream_unreachable" and exc.hop == replica.pool.url:
                self._mark_down(replica)
                if deadline.remaining() > 0:
                    raise _Lost() from exc
            # A timeout is not marked down here: the request's own deadline
            # may simply be short; a replica that hangs fails its probes.
            raise exc
        if not result:  # cancelled: its probes say it hangs
            raise _Lost(hung=True)
        response = result[0]
        if _not_this_stage(response):
            # It came back as another stage between two probes: take it out
            # now (if its identity says so) and fail the session over.
            replica.identity_read = False
            await self._read_identity(replica)
            if replica.mismatch:
                raise _Lost()
        if (
            isinstance(response, ErrorResponse)
            and response.status == 503
            and response.error.get("code") == "shutting_down"
            and response.error.get("hop") is None
        ):
            self._mark_down(replica)
            raise _Lost()
        return response

    async def _recover(
        self,
        session: str,
        headers: WireHeaders,
        body: bytes | bytearray | memoryview,
        deadline: Deadline,
        failed: Replica | None,
        *,
        alive: bool,
    ) -> ActivationResponse | ErrorResponse:
        """Move ``session`` to a replica that has (or is given) its state, then
        send the chunk there; again, elsewhere, if that replica fails too.

        ``alive``: ``failed`` did not fail a forward (it lost the session, or
        only its probes fail): it may be tried again when nothing else is left."""
        excluded: list[Replica] = [] if failed is None or alive else [failed]
        for _ in range(len(self.replicas) + 1):
            target, answered = await self._relocate(
                session, headers, body, deadline, failed, alive, excluded
            )
            if answered is not None:  # discovery: the chunk already went there
                return answered
            # Sent outside the session's lock: with several chunks in flight,
            # this one may wait at the replica for an earlier one, whose own
            # recovery must not wait for us.
            try:
                response = await self._attempt(target, headers, body, deadline)
            except _Lost as lost:
                failed, alive = target, lost.hung
                if not lost.hung:
                    excluded.append(target)
                continue
            if _lost_session(response):
                failed, alive = target, True
                continue
            self._keep(session, headers, body, response)
            return response
        raise self._none_left(session)

    async def _relocate(
        self,
        session: str,
        headers: WireHeaders,
        body: bytes | bytearray | memoryview,
        deadline: Deadline,
        failed: Replica | None,
        alive: bool,
        excluded: list[Replica],
    ) -> tuple[Replica, ActivationResponse | ErrorResponse | None]:
        """Under the session's lock: the replica to send to, its state rebuilt."""
        lock = self._locks.setdefault(session, anyio.Lock())
        async with lock:
            current = self._sticky.get(session)
            if (
                current is not None
                and current is not failed
                and current.up
                and not current.mismatch
            ):
                return current, None  # another chunk of the session moved it meanwhile
            if self.history.evicted(session):
                raise self._unrecoverable(session, "its history here was evicted (memory budget)")
            if current is None and failed is None:
                # Rebuilt by a replay ourselves, or never routed here: one of
                # the replicas may hold the session already. Ask, cheapest first.
                for candidate in self._ranked(exclude=excluded):
                    try:
                        response = await self._attempt(candidate, headers, body, deadline)
                    except _Lost:
                        excluded.append(candidate)
                        continue
                    if _lost_session(response):
                        continue
                    self._sticky[session] = candidate
                    self._keep(session, headers, body, response)
                    return candidate, response
            past = self.history.chunks(session, before=headers.position)
            if not past and not _starts(headers):
                raise self._unrecoverable(session, "no history of it is kept at this hop")
            # Ranked again after each loss: with no healthy replica left, the
            # down ones become candidates (see ``_ranked``).
            while candidates := self._ranked(exclude=excluded):
                candidate = candidates[0]
                try:
                    await self._replay(candidate, session, past, deadline)
                except _Lost:
                    excluded.append(candidate)
                    continue
                self.failovers += 1
                self._sticky[session] = candidate
                log.warning("session %s: failed over from %s to %s (%d chunks replayed)",
                            session, failed.url if failed else "?", candidate.url,
                            len(past))  # fmt: skip
                return candidate, None
            raise self._none_left(session)

    async def _replay(
        self, replica: Replica, session: str, past: list[SentChunk], deadline: Deadline
    ) -> None:
        for chunk in past:
            response = await self._attempt(
                replica, chunk.headers, chunk.body, deadline, REPLAY_PATH
            )
            if _stale_copy(response, chunk.headers):
                # The replica still holds an older copy of the session (it came
                # back after the failover away from it): a replay never rewrites
                # a live session (wire-2 §3.9), so end it there — there only:
                # the stages below keep theirs (?replay=1) — then once more.
                with contextlib.suppress(MeshnetError):  # the replay again says how it went
                    await replica.pool.request(
                        "DELETE", f"/sessions/{session}?replay=1", deadline,
                        key_headers(chunk.headers.session_key),
                    )  # fmt: skip
                response = await self._attempt(
                    replica, chunk.headers, chunk.body, deadline, REPLAY_PATH
                )
            if isinstance(response, ErrorResponse):
                inner = response.error
                raise DownstreamError(
                    f"stage {self.url}: session {session}: replay to {replica.url} failed: "
                    f"{response.status} {inner.get('code')}: {inner.get('message')}",
                    code="replay_failed",
                    status=502,
                    hop=replica.url,
                )
            self.replayed_chunks += 1
            self.replayed_tokens += chunk.headers.tokens
            self.replayed_bytes += memoryview(chunk.body).nbytes

    def _none_left(self, session: str) -> DownstreamError:
        down = ", ".join(r.url for r in self.replicas if not r.up) or "none"
        return DownstreamError(
            f"stage {self.url}: no replica left for session {session} (down: {down})",
            code="no_replica",
            status=502,
            hop=self.url,
        )

    def _unrecoverable(self, session: str, why: str) -> DownstreamError:
        return DownstreamError(
            f"stage {self.url}: session {session} cannot be recovered: {why}",
            code="session_lost",
            status=502,
            hop=self.url,
        )

    async def _any(self, call: Callable[[Replica], Awaitable[Any]]) -> Any:
        """A request any healthy replica may answer: the next one if one is gone."""
        last: MeshnetError | None = None
        for replica in self._ranked() or [r for r in self.replicas if not r.mismatch]:
            try:
                return await call(replica)
            except MeshnetError as exc:
                if exc.code != "downstream_unreachable":
                    raise
                self._mark_down(replica)
                last = exc
        if last is not None:
            raise last
        raise DownstreamError(f"stage {self.url}: no replica", code="no_replica", hop=self.url)

    # ------------------------------------------------------------ other requests

    async def request(
        self,
        method: str,
        target: str,
        deadline: Deadline,
        headers: Sequence[tuple[bytes, bytes]] = (),
        body: bytes = b"",
    ) -> Response | ErrorResponse:
        if method == "DELETE" and target.startswith("/sessions/"):
            return await self._delete_everywhere(target, deadline, headers)
        return await self._any(  # type: ignore[no-any-return]
            lambda r: r.pool.request(method, target, deadline, headers, body)
        )

    async def _delete_everywhere(
        self, target: str, deadline: Deadline, headers: Sequence[tuple[bytes, bytes]] = ()
    ) -> Response | ErrorResponse:
        """Every replica, so none that ever held the session keeps it: 204 when
        any knew it, else the first answer; an error only when none answered."""
        session = target.removeprefix("/sessions/")
        self.forget(session)
        answers: list[Response | ErrorResponse] = []
        errors: list[MeshnetError] = []

        async def one(replica: Replica) -> None:
            # A down replica is asked too (a hung one may wake up holding the
            # session), but not waited for longer than a probe.
            mine = deadline
            if not replica.up:
                mine = Deadline.after(min(deadline.remaining(), self.probe_timeout))
            try:
                answers.append(await replica.pool.request("DELETE", target, mine, headers))
            except MeshnetError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for replica in list(self.replicas):
                tg.start_soon(one, replica)
        for answer in answers:
            if answer.status == 204:
                return answer
        if answers:
            return answers[0]
        raise errors[0]

    async def deep_health(self, deadline: Deadline) -> dict[str, Any]:
        """Each replica's ``/health?deep=1``: ``ok``, ``degraded`` (some down,
        here or below) or a 502 when none answers (the stage is down)."""
        reports: dict[str, dict[str, Any]] = {}

        async def one(replica: Replica) -> None:
            state = {"state": "mismatch" if replica.mismatch else "ok"}
            if not replica.up:
                # Its probes already fail: asking again would only make this
                # answer (and every level above, which nests) wait for a hang.
                reports[replica.url] = {"up": False, "error": "its health probes fail", **state}
                return
            try:
                response = await replica.pool.request("GET", "/health?deep=1", deadline)
                if isinstance(response, ErrorResponse):
                    reports[replica.url] = {"up": False, "error": response.error, **state}
                    return
                health = json.loads(response.body)
                reports[replica.url] = {"up": True, "health": health, **state}
            except (MeshnetError, ValueError) as exc:
                reports[replica.url] = {"up": False, "error": str(exc), **state}

        async with anyio.create_task_group() as tg:
            for replica in list(self.replicas):
                tg.start_soon(one, replica)
        up = [r for r in reports.values() if r["up"]]
        refused = [r for r in reports.values() if _unauthorized(r.get("error"))]
        if not up and not refused:
            raise DownstreamError(
                f"stage {self.url} is down: no replica answers", code="stage_down", hop=self.url
            )
        # A 401 (another token) or another stage is for the chain check above
        # to name; here it is only not "ok".
        below_degraded = any(
            not isinstance(r["health"], dict) or r["health"].get("status") != "ok" for r in up
        )
        whole = len(up) == len(reports) and not any(r["state"] != "ok" for r in up)
        status = "ok" if whole and not below_degraded else "degraded"
        return {
            "status": status,
            "stage": self.url,
            "replicas": [{"url": url, **report} for url, report in sorted(reports.items())],
        }

    # ------------------------------------------------------------ upkeep

    async def maintain(self) -> None:
        """Probe the replicas (backoff for down ones) and re-resolve names."""
        next_dns = 0.0
        while True:
            now = anyio.current_time()
            if now >= next_dns:
                await self.resolve()
                next_dns = now + self.dns_interval
            async with anyio.create_task_group() as tg:
                for replica in list(self.replicas):
                    if replica.up or now >= replica.next_probe:
                        tg.start_soon(self._probe, replica)
            await self._drop_stale()
            # Idle past the nodes' TTL: they forgot the session, so do we.
            for session in self.history.expire(anyio.current_time(), self.limits.session_ttl):
                self.forget(session)
            await anyio.sleep(self.health_interval)

    async def _probe(self, replica: Replica) -> None:
        try:
            response = await replica.probe.request(
                "GET", "/health", Deadline.after(self.probe_timeout)
            )
        except MeshnetError as exc:
            # Refused or reset: down at once. Unanswered: down at the second
            # miss in a row (one slow answer on a loaded machine is not a hang).
            replica.probe_misses += 1
            if exc.code != "downstream_timeout" or replica.probe_misses >= 2 or not replica.up:
                self._mark_down(replica)
            return
        if isinstance(response, ErrorResponse):
            self._mark_down(replica)
            return
        replica.probe_misses = 0
        instance = _instance(response.body)
        restarted = instance != replica.instance and replica.instance is not None
        replica.instance = instance
        if not replica.up or not replica.identity_read or restarted:
            # Back up (perhaps restarted as something else) or new: what does
            # it serve? Read before it is used again.
            replica.identity_read = False
            await self._read_identity(replica)
        if not replica.up:
            replica.mark_up()
            self._changed()

    async def _drop_stale(self) -> None:
        """Stickiness to a replica that is down stays (the next chunk fails
        over); a retired replica with no sessions is closed and removed."""
        held = {r.url for r in self._sticky.values()}
        for replica in [r for r in self.replicas if r.retired and r.url not in held]:
            if replica.inflight == 0 and len(self.replicas) > 1:
                self.replicas.remove(replica)
                await replica.pool.aclose()
                await replica.probe.aclose()

    def describe(self) -> dict[str, Any]:
        load = self._session_counts()
        return {
            "stage": self.url,
            "replicas": [
                {
                    "url": r.url,
                    "up": r.up,
                    "retired": r.retired,
                    "inflight": r.inflight,
                    "sessions": load.get(r.url, 0),
                    "fingerprint": r.fingerprint,
                    "mismatch": r.mismatch,
                }
                for r in self.replicas
            ],
            "pinned": self.pinned,
            "failovers": self.failovers,
            "replayed": {
                "chunks": self.replayed_chunks,
                "tokens": self.replayed_tokens,
                "bytes": self.replayed_bytes,
            },
            "history": {"sessions": len(self.history), "bytes": self.history.nbytes},
        }

    @property
    def idle_connections(self) -> int:
        return sum(r.pool.idle_connections for r in self.replicas)

    async def aclose(self) -> None:
        for replica in self.replicas:
            await replica.pool.aclose()
            await replica.probe.aclose()


def _starts(headers: WireHeaders) -> bool:
    """The first chunk of a new session: nothing to replay before it."""
    return (headers.chunk_index or 0) == 0 and (headers.position or 0) == 0


def _unauthorized(error: Any) -> bool:
    return isinstance(error, dict) and error.get("code") == "unauthorized"


def _not_this_stage(response: ActivationResponse | ErrorResponse) -> bool:
    """The replica itself refused the chunk as meant for another stage."""
    return (
        isinstance(response, ErrorResponse)
        and response.error.get("code") == "stage_mismatch"
        and response.error.get("hop") is None
    )


def _instance(body: bytes | bytearray | memoryview) -> str | None:
    """The ``instance`` of a /health answer, if it is one that names it."""
    try:
        document = json.loads(bytes(body))
    except ValueError:
        return None
    instance = document.get("instance") if isinstance(document, dict) else None
    return instance if isinstance(instance, str) else None


def _stale_copy(response: ActivationResponse | ErrorResponse, headers: WireHeaders) -> bool:
    """The replica answered a replay's first chunk that it holds the session."""
    return (
        isinstance(response, ErrorResponse)
        and response.error.get("code") == "session_exists"
        and response.error.get("hop") is None
        and _starts(headers)
    )


def _lost_session(response: ActivationResponse | ErrorResponse) -> bool:
    """The replica itself (not a node below it) does not hold the session."""
    return (
        isinstance(response, ErrorResponse)
        and response.error.get("code") == "session_unknown"
        and response.error.get("hop") is None
    )


class _ReplicaCollector:
    """Prometheus views of a replica set, computed when scraped."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[Any]:
        rs = self.replicas
        load = rs._session_counts()
        up = GaugeMetricFamily("meshnet_replica_up", "1 while the replica answers its probes",
                               labels=["stage", "replica"])  # fmt: skip
        sessions = GaugeMetricFamily("meshnet_replica_sessions", "Sessions stuck to the replica",
                                     labels=["stage", "replica"])  # fmt: skip
        for replica in rs.replicas:
            up.add_metric([rs.url, replica.url], 1.0 if replica.up else 0.0)
            sessions.add_metric([rs.url, replica.url], float(load.get(replica.url, 0)))
        failovers = CounterMetricFamily("meshnet_failovers", "Sessions moved to another replica",
                                        labels=["stage"])  # fmt: skip
        failovers.add_metric([rs.url], float(rs.failovers))
        replayed = CounterMetricFamily("meshnet_replayed", "What failovers replayed to a replica",
                                       labels=["stage", "unit"])  # fmt: skip
        for unit in ("chunks", "tokens", "bytes"):
            replayed.add_metric([rs.url, unit], float(getattr(rs, f"replayed_{unit}")))
        yield from (up, sessions, failovers, replayed)
