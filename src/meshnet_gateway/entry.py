"""The gateway's entry hop: its pool (one node or a replica set) and what
the gateway reads of it (the reorder window in its ``/info``, wire-2 §1)."""

from __future__ import annotations

from typing import Any

from meshnet_runtime.downstream import Downstream, DownstreamPool
from meshnet_runtime.metrics import ServerMetrics
from meshnet_runtime.replicas import ReplicaSet, needs_replica_set

from .config import GatewayConfig

__all__ = ["entry_downstream", "reorder_window"]


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
    return DownstreamPool(
        config.entry,
        limits=config.limits,
        token=config.token,
        ssl_context=_client_ssl(config),
        metrics=metrics,
    )
