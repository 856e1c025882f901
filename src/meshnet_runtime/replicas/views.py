"""What a replica set shows: the ``replicas`` of ``/info`` and its
Prometheus series (docs/failover.md, "Guarantees")."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..history import HistoryStore
from .failover import Failover
from .placement import Placement
from .replica import Replica

__all__ = ["ReplicaCollector", "describe"]


def describe(
    stage: str, placement: Placement[Replica], failover: Failover, history: HistoryStore
) -> dict[str, Any]:
    """The ``replicas`` document of ``/info``."""
    load = placement.session_counts()
    return {
        "stage": stage,
        "replicas": [
            {
                "url": r.url,
                "up": r.up,
                "retired": r.retired,
                "inflight": r.inflight,
                "sessions": load.get(r.url, 0),
                "fingerprint": r.fingerprint,
                "mismatch": r.mismatch,
                "kv_role": r.kv_role,
            }
            for r in placement.replicas
        ],
        "pinned": placement.pinned,
        "failovers": failover.failovers,
        # wire-2 §3.10: new sessions sent to the replica holding their prefix
        "prefix_placed": placement.prefix_placed,
        "replayed": {
            "chunks": failover.replayed_chunks,
            "tokens": failover.replayed_tokens,
            "bytes": failover.replayed_bytes,
        },
        "history": {"sessions": len(history), "bytes": history.nbytes},
        # wire-2 §3.11: sessions moved by their KV (no replay), moves given up, bytes
        "handoff": {
            "moved": failover.handoffs.moved,
            "failed": failover.handoffs.failed,
            "bytes": failover.handoffs.bytes,
        },
    }


class ReplicaCollector:
    """Prometheus views of a replica set, computed when scraped from its
    ``describe()`` document."""

    # Not ``describe``: the registry takes a collector's describe() for the
    # series it would register.
    def __init__(self, document: Callable[[], dict[str, Any]]) -> None:
        self.document = document

    def collect(self) -> Iterator[Any]:
        view = self.document()
        stage = view["stage"]
        up = GaugeMetricFamily(
            "meshnet_replica_up",
            "1 while the replica answers its probes",
            labels=["stage", "replica"],
        )
        sessions = GaugeMetricFamily(
            "meshnet_replica_sessions", "Sessions stuck to the replica", labels=["stage", "replica"]
        )
        for replica in view["replicas"]:
            up.add_metric([stage, replica["url"]], 1.0 if replica["up"] else 0.0)
            sessions.add_metric([stage, replica["url"]], float(replica["sessions"]))
        failovers = CounterMetricFamily(
            "meshnet_failovers", "Sessions moved to another replica", labels=["stage"]
        )
        failovers.add_metric([stage], float(view["failovers"]))
        replayed = CounterMetricFamily(
            "meshnet_replayed", "What failovers replayed to a replica", labels=["stage", "unit"]
        )
        for unit in ("chunks", "tokens", "bytes"):
            replayed.add_metric([stage, unit], float(view["replayed"][unit]))
        placed = CounterMetricFamily(
            "meshnet_prefix_placed",
            "New sessions sent to the replica holding their cached prefix",
            labels=["stage"],
        )
        placed.add_metric([stage], float(view["prefix_placed"]))
        handoffs = CounterMetricFamily(
            "meshnet_handoffs",
            "Sessions moved to another replica by their KV (moved), or moves given up (failed)",
            labels=["stage", "outcome"],
        )
        for outcome in ("moved", "failed"):
            handoffs.add_metric([stage, outcome], float(view["handoff"][outcome]))
        handoff_bytes = CounterMetricFamily(
            "meshnet_handoff_moved_bytes", "KV bytes carried by hand-offs", labels=["stage"]
        )
        handoff_bytes.add_metric([stage], float(view["handoff"]["bytes"]))
        yield from (up, sessions, failovers, replayed, placed, handoffs, handoff_bytes)
