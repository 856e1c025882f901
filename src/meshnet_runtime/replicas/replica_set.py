"""The replica set's driver: one object with a ``DownstreamPool``'s API.

``ReplicaSet`` stands where a ``DownstreamPool`` stood (a node's ``--next``,
the gateway's ``--entry``) and speaks the same API (``forward``,
``request``, ``url``, ``link``, ``aclose``), plus ``maintain`` (the health
task), ``deep_health``, ``describe`` and the replay hooks a node calls. It
composes the parts: ``Placement`` decides, ``HealthMonitor`` probes and
resolves, ``Failover`` sends and moves sessions, ``fanout`` asks every
replica at once.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio

from meshnet_proto import (
    ActivationResponse,
    DownstreamError,
    ErrorCode,
    ErrorResponse,
    Limits,
    MeshnetError,
    Response,
    WireHeaders,
)

from ..deadlines import Deadline
from ..endpoints import Endpoint
from ..history import HistoryStore
from ..link import LinkEstimate
from ..metrics import ServerMetrics
from .failover import Failover, Lost, lost_session
from .fanout import deep_health, delete_everywhere
from .handoff import MoveBackoff, disaggregated_target, hand_off
from .monitor import HealthMonitor, Resolver, resolve_name
from .placement import Placement, is_name
from .replica import Replica, open_replica
from .views import ReplicaCollector, describe

__all__ = ["ReplicaSet"]

_T = TypeVar("_T")  # what one replica's answer is, as _any hands it back

Body = bytes | bytearray | memoryview


class ReplicaSet:
    """The replicas of one hop behind a ``DownstreamPool``'s API (see the package's docstring)."""

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
        self.resolver = resolver or resolve_name
        self.history = HistoryStore(max_history_bytes)
        # ``on_change`` hears of every change of membership or state (the
        # gateway's chain re-check); a cache of deep health is keyed by ``version``.
        self.placement: Placement[Replica] = Placement(health_interval, on_change)
        for endpoint in self.endpoints:
            if not is_name(endpoint) or endpoint.host == "localhost":
                self.placement.add(self._open(endpoint.url, endpoint.url))
        self.monitor = HealthMonitor(
            self.placement,
            self.endpoints,
            self._open,
            interval=health_interval,
            probe_timeout=probe_timeout,
            dns_interval=self.dns_interval,
            resolver=self.resolver,
        )
        self.failover = Failover(
            self.url, self.placement, self.history, self.monitor, probe_timeout
        )
        # A refused prefill/decode move is not tried again on every decode step.
        self.moves = MoveBackoff()
        replicas = self.placement.replicas
        self.margin = replicas[0].pool.margin if replicas else 0.1
        # --encoding auto weighs one link: the replicas' are alike enough.
        self.link = replicas[0].pool.link if replicas else LinkEstimate()
        if metrics is not None:
            metrics.registry.register(ReplicaCollector(self.describe))

    def _open(self, url: str, source: str) -> Replica:
        return open_replica(
            url,
            source,
            limits=self.limits,
            token=self.token,
            ssl_context=self.ssl_context,
            metrics=self.metrics,
        )

    # ------------------------------------------------------------ state, as before

    @property
    def replicas(self) -> list[Replica]:
        return self.placement.replicas

    @property
    def _sticky(self) -> dict[str, Replica]:
        return self.placement.sticky

    @property
    def pinned(self) -> str | None:
        """The fingerprint of the stage this hop serves: the first a replica showed."""
        return self.placement.pinned

    @property
    def version(self) -> int:
        return self.placement.version

    @property
    def on_change(self) -> Callable[[], None] | None:
        return self.placement.on_change

    @on_change.setter
    def on_change(self, hook: Callable[[], None] | None) -> None:
        self.placement.on_change = hook

    @property
    def failovers(self) -> int:
        return self.failover.failovers

    @property
    def replayed_chunks(self) -> int:
        return self.failover.replayed_chunks

    @property
    def replayed_tokens(self) -> int:
        return self.failover.replayed_tokens

    @property
    def replayed_bytes(self) -> int:
        return self.failover.replayed_bytes

    def holder(self, session: str) -> str | None:
        """The URL of the replica a session sticks to (tests, /info)."""
        return self.placement.holder(session)

    def _none_left(self, session: str) -> DownstreamError:
        return self.failover.none_left(session)

    # ------------------------------------------------------------ forward

    async def forward(
        self,
        headers: WireHeaders,
        body: Body,
        deadline: Deadline,
        path: str = "/forward",
    ) -> ActivationResponse | ErrorResponse:
        session = headers.session
        if session is None:  # nothing to stick to: any healthy replica
            return await self._any(lambda r: r.pool.forward(headers, body, deadline, path))
        route = self.placement.route(session, headers.starts_session, headers.prefix)
        if route is None:
            raise self._none_left(session)
        failover = self.failover
        replica = route.replica
        if route.recover or replica is None:
            return await failover.recover(
                session, headers, body, deadline, replica, alive=route.alive
            )
        decoder = disaggregated_target(self.placement, replica, headers, self.moves)
        if decoder is not None:  # its prompt is done: to a decode replica (wire-2 §3.12)
            async with failover.lock(session):
                if await hand_off(
                    replica,
                    decoder,
                    session,
                    headers.session_key,
                    deadline,
                    failover.handoffs,
                    backoff=self.moves,
                ):
                    replica = self._sticky[session] = decoder
        try:
            response = await failover.attempt(replica, headers, body, deadline)
        except Lost as lost:
            return await failover.recover(
                session, headers, body, deadline, replica, alive=lost.hung
            )
        if lost_session(response):
            return await failover.recover(session, headers, body, deadline, replica, alive=True)
        failover.keep(session, headers, body, response)
        if (headers.prefix_blocks or headers.prefix) and not isinstance(response, ErrorResponse):
            attached = (headers.prefix,) if headers.prefix is not None else ()
            self.placement.filed(replica, attached + headers.prefix_blocks)
        moved = self._sticky.get(session)
        if moved is not None and moved is not replica and not isinstance(response, ErrorResponse):
            # Answered by the replica the session just left (a draining one
            # finishes what it has), after the move's replay was read: the
            # new replica must get this chunk too, or later ones wait for it.
            await failover.catch_up(moved, session, headers, body, deadline)
        return response

    def record_replayed(self, session: str, headers: WireHeaders, body: Body) -> None:
        """A replay rebuilt this node: keep what it would have sent, as if sent.

        The session's replica below is not known here (discovery finds it)."""
        self.history.add(session, headers, body, anyio.current_time())
        self._sticky.pop(session, None)

    def forget(self, session: str) -> None:
        """The session ended here: no history, no stickiness."""
        self.history.forget(session)
        self._sticky.pop(session, None)
        self.failover.forget(session)
        self.moves.forget(session)

    async def _any(self, call: Callable[[Replica], Awaitable[_T]]) -> _T:
        """A request any healthy replica may answer: the next one if one is gone."""
        last: MeshnetError | None = None
        for replica in self.placement.any_order():
            try:
                return await call(replica)
            except MeshnetError as exc:
                if exc.code != "downstream_unreachable":
                    raise
                self.placement.mark_down(replica, anyio.current_time())
                last = exc
        if last is not None:
            raise last
        raise DownstreamError(
            f"stage {self.url}: no replica", code=ErrorCode.NO_REPLICA, hop=self.url
        )

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
            self.forget(target.removeprefix("/sessions/"))
            return await delete_everywhere(
                self.replicas, target, deadline, headers, self.probe_timeout
            )
        return await self._any(lambda r: r.pool.request(method, target, deadline, headers, body))

    async def deep_health(self, deadline: Deadline) -> dict[str, Any]:
        """``downstream``: each replica's ``/health?deep=1``, ``ok``,
        ``degraded`` (some down, here or below) or a 502 when none answers
        (the stage is down)."""
        return {"downstream": await deep_health(self.url, self.replicas, deadline)}

    # ------------------------------------------------------------ upkeep

    async def maintain(self) -> None:
        """Probe the replicas (backoff for down ones) and re-resolve names."""
        await self.monitor.run(self._expire)

    def _expire(self, now: float) -> None:
        # Idle past the nodes' TTL: they forgot the session, so do we.
        for session in self.history.expire(now, self.limits.session_ttl):
            self.forget(session)

    async def resolve(self) -> None:
        """Re-resolve every named URL: new addresses join, vanished ones retire."""
        await self.monitor.resolve()

    def describe(self) -> dict[str, Any]:
        return describe(self.url, self.placement, self.failover, self.history)

    @property
    def idle_connections(self) -> int:
        return sum(r.pool.idle_connections for r in self.replicas)

    async def aclose(self) -> None:
        for replica in self.replicas:
            await replica.aclose()
