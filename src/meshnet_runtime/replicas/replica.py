"""One replica as the driver holds it: its record, its pools, and the event
that stops the forwards waiting on it when it goes down."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import anyio

from meshnet_proto import Limits

from ..downstream import DownstreamPool
from ..endpoints import parse_endpoint
from ..metrics import ServerMetrics
from .placement import ReplicaState

__all__ = ["Replica", "open_replica"]


@dataclass(eq=False, slots=True, kw_only=True)
class Replica(ReplicaState):
    """One node of the hop, with its own pool and probe connection."""

    pool: DownstreamPool
    probe: DownstreamPool
    # Set when it goes down: forwards waiting on it stop waiting. Made on
    # first use (an anyio Event needs a running loop).
    _went_down: anyio.Event | None = None

    def went_down(self) -> anyio.Event:
        if self._went_down is None:
            self._went_down = anyio.Event()
        return self._went_down

    def mark_down(self, now: float, interval: float) -> None:
        # Named, not super(): a slots dataclass is a new class (bpo-46404).
        ReplicaState.mark_down(self, now, interval)
        self.went_down().set()

    def mark_up(self) -> None:
        if not self.up:
            self._went_down = None
        ReplicaState.mark_up(self)

    async def aclose(self) -> None:
        await self.pool.aclose()
        await self.probe.aclose()


def open_replica(
    url: str,
    source: str,
    *,
    limits: Limits,
    token: str | None,
    ssl_context: ssl.SSLContext | None,
    metrics: ServerMetrics | None,
) -> Replica:
    """A replica at ``url``: 16 connections for forwards, one for probes."""

    def pool(connections: int) -> DownstreamPool:
        return DownstreamPool(
            parse_endpoint(url),
            limits=limits,
            token=token,
            ssl_context=ssl_context,
            max_connections=connections,
            metrics=metrics,
        )

    return Replica(url=url, source=source, pool=pool(16), probe=pool(1))
