"""Prometheus metrics, one registry per server instance.

Not the global registry: tests and ``meshnet demo`` run several servers in
one process, and each ``/metrics`` must describe only its own server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

__all__ = ["METRICS_CONTENT_TYPE", "ReadAtScrape", "ServerMetrics", "endpoint_label"]

# (kind "counter" or "gauge", name, help, value) of one unlabelled sample.
Sample = tuple[str, str, str, float]


class ReadAtScrape(Collector):
    """Counts another object keeps (a cache's hits, bytes it holds), read
    when ``/metrics`` is scraped: nothing to increment on the hot path."""

    def __init__(self, samples: Callable[[], Iterable[Sample]]) -> None:
        self.samples = samples

    def collect(self) -> Iterator[Metric]:
        for kind, name, text, value in self.samples():
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, text, value=value)


METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST

# Label values are bounded: an unknown path must not grow the series set.
_KNOWN = (
    "/forward", "/health", "/info", "/metrics",
    "/v1/models", "/v1/completions", "/v1/chat/completions",  # the gateway's OpenAI API
)  # fmt: skip


def endpoint_label(path: str) -> str:
    """A bounded ``endpoint`` label for a request path."""
    if path in _KNOWN:
        return path
    if path.startswith("/sessions/"):
        return "/sessions"
    if path.startswith("/v1/models/"):
        return "/v1/models"
    return "other"


# Stage and codec times span sub-millisecond echo to multi-second layers.
_SECONDS_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


class ServerMetrics:
    """The metrics of one node or gateway; ``render()`` is the ``/metrics`` body."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "meshnet_requests", "Requests answered, by endpoint and status",
            ["endpoint", "status"], registry=r,
        )  # fmt: skip
        self.chunks = Counter(
            "meshnet_chunks", "Activation chunks answered, by outcome",
            ["outcome"], registry=r,
        )  # fmt: skip
        # peer: "upstream" (our clients) or "downstream" (our --next/--entry).
        self.bytes_in = Counter(
            "meshnet_body_bytes_in", "Activation body bytes received, on the wire",
            ["peer"], registry=r,
        )  # fmt: skip
        self.bytes_out = Counter(
            "meshnet_body_bytes_out", "Activation body bytes sent, on the wire",
            ["peer"], registry=r,
        )  # fmt: skip
        self.sessions = Gauge("meshnet_sessions", "Sessions currently held", registry=r)
        self.connections = Gauge("meshnet_connections", "Open client connections", registry=r)
        self.inflight_bytes = Gauge(
            "meshnet_inflight_tensor_bytes",
            "Tensor bytes reserved for requests in flight (--max-inflight-bytes)",
            registry=r,
        )
        self.stage_seconds = Histogram(
            "meshnet_stage_seconds", "Stage compute time per chunk",
            buckets=_SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.codec_seconds = Histogram(
            "meshnet_codec_seconds", "Tensor encode/decode time",
            ["op"], buckets=_SECONDS_BUCKETS, registry=r,
        )  # fmt: skip

    def labelled(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, remembered: ``labels()`` takes a lock and
        rebuilds its key on every call, a few percent of a decode step's node
        time (meshnet bench, section decode). A child is created on first use,
        as with ``labels()``, so /metrics shows the same series."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def observe_request(self, path: str, status: int) -> None:
        self.labelled(self.requests, endpoint_label(path), str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
