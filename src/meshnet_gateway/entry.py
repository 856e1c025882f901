"""The gateway's entry hop: its pool (one node or a replica set) and what
the gateway reads of it (the reorder window in its ``/info``, wire-2 §1)."""

from __future__ import annotations

import json
import logging
from typing import Any

import anyio
import anyio.abc

from meshnet_proto import ErrorResponse, Limits, MeshnetError
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import Downstream, DownstreamPool
from meshnet_runtime.endpoints import Endpoint
from meshnet_runtime.metrics import ServerMetrics
from meshnet_runtime.replicas import ReplicaSet, needs_replica_set

from .config import GatewayConfig

__all__ = [
    "INFO_TIMEOUT",
    "STARTUP_INFO_ATTEMPTS",
    "STARTUP_INFO_RETRY_S",
    "WIRE2_REORDER_WINDOW",
    "EntryWindow",
    "entry_downstream",
    "last_stage_pool",
    "reorder_window",
]

log = logging.getLogger("meshnet.gateway")

# Asking the entry node for its /info must not hold up startup for long, and
# never a request: until it answers, one chunk at a time (every window is
# >= 1) and the question is asked again, in the background, on each request.
INFO_TIMEOUT = 2.0
# Started together with its chain (one shell, `&`), the gateway may come up
# before the entry node listens: it asks again this often, this many times,
# quietly, and warns only if the entry still has not answered.
STARTUP_INFO_RETRY_S = 0.5
STARTUP_INFO_ATTEMPTS = 20
# What a node whose /info names none has: the core's (wire-2 §3) default.
WIRE2_REORDER_WINDOW = Limits().reorder_window


class EntryWindow:
    """The entry node's reorder window, read from its ``GET /info``: what
    caps ``--inflight`` (``configured``) at the gateway (wire-2 §1)."""

    def __init__(self, pool: Downstream, configured: int) -> None:
        self.pool = pool
        self.configured = configured
        self.window: int | None = None  # the entry node's reorder window, once known
        self.read = False  # its /info answered (a window may still be absent)
        self._refreshing = False

    @property
    def inflight(self) -> int:
        """``--inflight`` capped at the entry node's reorder window."""
        if not self.read:
            return 1  # safe under any window until the entry tells us its own
        return min(self.configured, self.window or WIRE2_REORDER_WINDOW)

    async def refresh(self, *, quiet: bool = False) -> int | None:
        """Read the entry node's reorder window from its ``GET /info``.

        ``quiet``: a failure is logged at debug level (the startup attempts).
        """
        try:
            response = await self.pool.request("GET", "/info", Deadline.after(INFO_TIMEOUT))
            if isinstance(response, ErrorResponse):
                raise response.to_error(hop=self.pool.url)
            self.window = reorder_window(json.loads(response.body))
        except (MeshnetError, ValueError) as exc:
            level = logging.DEBUG if quiet else logging.WARNING
            log.log(level, "cannot read the reorder window of %s: %s", self.pool.url, exc)
            return None
        self.read = True
        if self.window is None:
            log.warning(
                "%s /info shows no reorder window; assuming %d", self.pool.url, WIRE2_REORDER_WINDOW
            )
        elif self.configured > self.window:
            log.info(
                "--inflight %d capped at the entry node's reorder window %d",
                self.configured,
                self.window,
            )
        return self.window

    async def read_at_start(self) -> None:
        """Ask again, quietly, while the entry comes up (see ``STARTUP_INFO_ATTEMPTS``)."""
        for attempt in range(1, STARTUP_INFO_ATTEMPTS + 1):
            await anyio.sleep(STARTUP_INFO_RETRY_S)
            if not self.read:  # a request's own refresh may have got there
                await self.refresh(quiet=attempt < STARTUP_INFO_ATTEMPTS)
            if self.read:
                return

    def refresh_soon(self, tg: anyio.abc.TaskGroup | None) -> None:
        """Until the window is known, each request asks again in the
        background (one question at a time; none outside ``tg``)."""
        if not self.read and tg is not None and not self._refreshing:
            tg.start_soon(self._refresh_in_background)

    async def _refresh_in_background(self) -> None:
        self._refreshing = True
        try:
            await self.refresh()
        finally:
            self._refreshing = False


def reorder_window(info: Any) -> int | None:
    """The reorder window in a node's ``/info`` (top level or under ``limits``)."""
    if not isinstance(info, dict):
        raise ValueError("/info is not a JSON object")
    for where in (info, info.get("limits"), info.get("sessions")):
        if isinstance(where, dict):
            value = where.get("reorder_window")
            if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                return value
    return None


def _client_ssl(config: GatewayConfig) -> Any:
    if config.entry is not None and config.entry.tls:
        from meshnet_runtime.transports import client_ssl_context

        return client_ssl_context(config.tls_ca)
    return None


def entry_downstream(config: GatewayConfig, metrics: ServerMetrics) -> Downstream:
    """The entry hop: one node's pool, or a replica set (docs/failover.md)."""
    assert config.entry is not None
    replicas = config.entry_replicas or (config.entry,)
    if needs_replica_set(replicas):
        return ReplicaSet(
            replicas,
            limits=config.limits,
            token=config.token,
            ssl_context=_client_ssl(config),
            metrics=metrics,
            health_interval=config.health_interval,
            probe_timeout=config.probe_timeout,
            max_history_bytes=config.max_history_bytes,
        )
    return _node_pool(config.entry, config, metrics)


def last_stage_pool(config: GatewayConfig, metrics: ServerMetrics) -> DownstreamPool | None:
    """``--direct-return``: the last stage, polled for each decode step's
    token (wire-2 §3.14), with the chain's token and TLS; None without it."""
    if config.direct_return is None:
        return None
    return _node_pool(config.direct_return, config, metrics)


def _node_pool(
    url: Endpoint | str, config: GatewayConfig, metrics: ServerMetrics
) -> DownstreamPool:
    """Connections to one node, with the chain's limits, token and TLS."""
    return DownstreamPool(
        url,
        limits=config.limits,
        token=config.token,
        ssl_context=_client_ssl(config),
        metrics=metrics,
    )
