"""The hop below a node: none (the last stage), one node, or a replica set."""

from __future__ import annotations

from meshnet_runtime.downstream import Downstream, DownstreamPool
from meshnet_runtime.metrics import ServerMetrics
from meshnet_runtime.replicas import ReplicaSet, needs_replica_set
from meshnet_runtime.transports import client_ssl_context

from .config import NodeConfig

__all__ = ["next_hop"]


def next_hop(config: NodeConfig, metrics: ServerMetrics) -> Downstream | None:
    """The hop below: none (the last stage), one node, or a replica set
    (several nodes serve the next stage: sessions stick, fail over, replay)."""
    replicas = config.next_replicas or ((config.next,) if config.next else ())
    if needs_replica_set(replicas):
        return ReplicaSet(
            replicas,
            limits=config.limits,
            token=config.token,
            ssl_context=client_ssl_context(config.tls_ca) if replicas[0].tls else None,
            metrics=metrics,
            health_interval=config.health_interval,
            probe_timeout=config.probe_timeout,
            max_history_bytes=config.max_history_bytes,
        )
    if config.next is None:
        return None
    return DownstreamPool(
        config.next,
        limits=config.limits,
        token=config.token,
        ssl_context=client_ssl_context(config.tls_ca) if config.next.tls else None,
        metrics=metrics,
    )
