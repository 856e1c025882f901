"""The replica set's upkeep task: health probes, DNS membership, identities.

Every ``interval`` it probes each replica that is up, and each down one
whose backoff ended (``GET /health``); every ``dns_interval`` it resolves
the named URLs again; a replica that is new, back up or restarted has its
``/info`` identity read before it is used again (docs/failover.md,
"Health", "Pinning"). What each outcome changes is decided by
``Placement``; this module does the asking.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

import anyio

from meshnet_proto import ErrorResponse, MeshnetError

from ..deadlines import Deadline
from ..endpoints import Endpoint
from .placement import Placement, address_url, is_name
from .replica import Replica

__all__ = ["HealthMonitor", "Resolver", "instance_of", "resolve_name"]

log = logging.getLogger("meshnet.replicas")

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_name(host: str, port: int) -> list[str]:
    """The event loop's resolver: the name's addresses, sorted."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def instance_of(body: bytes | bytearray | memoryview) -> str | None:
    """The ``instance`` of a /health answer, if it is one that names it."""
    try:
        document = json.loads(bytes(body))
    except ValueError:
        return None
    instance = document.get("instance") if isinstance(document, dict) else None
    return instance if isinstance(instance, str) else None


class HealthMonitor:
    """Probes, resolves and reads identities for one ``Placement``.

    ``open_replica(url, source)`` makes a replica for an address a name
    gained; ``on_round(now)`` runs after each round of probes."""

    def __init__(
        self,
        placement: Placement[Replica],
        endpoints: Sequence[Endpoint],
        open_replica: Callable[[str, str], Replica],
        *,
        interval: float,
        probe_timeout: float,
        dns_interval: float,
        resolver: Resolver,
    ) -> None:
        self.placement = placement
        self.endpoints = tuple(endpoints)
        self.open_replica = open_replica
        self.interval = interval
        self.probe_timeout = probe_timeout
        self.dns_interval = dns_interval
        self.resolver = resolver

    async def run(self, on_round: Callable[[float], None]) -> None:
        """Probe the replicas (backoff for down ones) and re-resolve names."""
        next_dns = 0.0
        while True:
            now = anyio.current_time()
            if now >= next_dns:
                await self.resolve()
                next_dns = now + self.dns_interval
            async with anyio.create_task_group() as tg:
                for replica in self.placement.due(now):
                    tg.start_soon(self.probe, replica)
            for replica in self.placement.drop_stale():
                await replica.aclose()
            on_round(anyio.current_time())
            await anyio.sleep(self.interval)

    async def resolve(self) -> None:
        """Re-resolve every named URL: new addresses join, vanished ones retire."""
        for endpoint in self.endpoints:
            host = endpoint.host
            # A name has a host (is_name says False without one).
            if host is None or not is_name(endpoint) or host == "localhost":
                continue
            try:
                addresses = await self.resolver(host, endpoint.port or 0)
            except OSError as exc:
                log.warning("cannot resolve %s: %s", host, exc)
                continue
            urls = {address_url(endpoint, a) for a in addresses}
            for url in self.placement.resolved(endpoint.url, urls):
                log.info("replica %s joins %s", url, endpoint.url)
                # Its /info is read at its first probe.
                self.placement.add(self.open_replica(url, endpoint.url))
                self.placement.changed()

    async def probe(self, replica: Replica) -> None:
        try:
            response = await replica.probe.request(
                "GET", "/health", Deadline.after(self.probe_timeout)
            )
        except MeshnetError as exc:
            self.placement.probe_failed(
                replica, anyio.current_time(), unanswered=exc.code == "downstream_timeout"
            )
            return
        if isinstance(response, ErrorResponse):
            replica.draining = response.error.get("code") == "shutting_down"
            self.placement.mark_down(replica, anyio.current_time())
            return
        if self.placement.probe_answered(replica, instance_of(response.body)):
            # Back up (perhaps restarted as something else) or new: what does
            # it serve? Read before it is used again.
            await self.read_identity(replica)
        self.placement.back_up(replica)

    async def read_identity(self, replica: Replica) -> None:
        """Read what ``replica`` serves; take it out if it is not the pinned stage."""
        try:
            response = await replica.probe.request(
                "GET", "/info", Deadline.after(self.probe_timeout)
            )
            if isinstance(response, ErrorResponse):
                raise response.to_error(hop=replica.url)
            info = json.loads(response.body)
            identity = info.get("identity")
            fingerprint = identity.get("fingerprint") if isinstance(identity, dict) else None
            handoff = info.get("handoff")
            role = handoff.get("role") if isinstance(handoff, dict) else None
        except (MeshnetError, ValueError, AttributeError) as exc:
            # Asked again at the next probe; deep health shows why meanwhile.
            log.debug("cannot read the identity of %s: %s", replica.url, exc)
            return
        # Registration (wire-2 §3.12): its role; anything else is "any".
        replica.kv_role = role if role in ("prefill", "decode") else "any"
        # A node too old to say has nothing to pin.
        self.placement.pin(replica, fingerprint if isinstance(fingerprint, str) else None)
