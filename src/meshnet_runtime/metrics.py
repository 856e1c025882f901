"""Prometheus metrics, one registry per server instance.

Not the global registry: tests and ``meshnet demo`` run several servers in
one process, and each ``/metrics`` must describe only its own server.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = [
    "METRICS_CONTENT_TYPE",
    "ReadAtScrape",
    "ServerMetrics",
    "Tally",
    "TallyHistogram",
    "endpoint_label",
]

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


class _Count:
    """One series of a ``Tally``: a plain number."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class Tally(Collector):
    """A counter whose series are plain numbers, read when ``/metrics`` is
    scraped: what a decode step counts (requests, chunks, bytes, tokens).

    prometheus_client's ``Counter`` takes a lock on every ``inc``; five of
    them were ~3 % of a decode step's node time (section decode). A tally is
    counted on the event loop's thread only (every request's counts are),
    so it needs none. Same exposition as a ``Counter`` of that name and
    labels (``<name>_total``), without the ``_created`` series.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Iterable[str] = (),
        *,
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], _Count] = {}
        registry.register(self)

    def labels(self, *values: str) -> _Count:
        """The series of these label values (made on first use, as a Counter's)."""
        series = self._series.get(values)
        if series is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            series = self._series[values] = _Count()
        return series

    def inc(self, amount: float = 1.0) -> None:
        """Count on the unlabelled series (a tally without labels)."""
        self.labels().inc(amount)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in list(self._series.items()):
            family.add_metric(values, series.value)
        yield family


class TallyHistogram(Collector):
    """A histogram kept as plain numbers, read at scrape: what every chunk
    observes (its stage time). prometheus_client's ``Histogram`` walks its
    buckets in Python and takes two locks per ``observe``, ~2 % of a decode
    step; this finds the bucket with ``bisect`` and, observed on the event
    loop's thread only, needs no lock. Same exposition as a ``Histogram``
    (``_bucket`` cumulative with ``+Inf``, ``_count``, ``_sum``), without
    ``_created``."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        *,
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(sorted(buckets))
        self._counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self._sum = 0.0
        registry.register(self)

    def observe(self, amount: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, amount)] += 1
        self._sum += amount

    def collect(self) -> Iterator[Metric]:
        cumulative, running = [], 0
        for bound, count in zip((*self.bounds, math.inf), self._counts, strict=True):
            running += count
            # prometheus_client leaves this helper unannotated (str in, str out).
            cumulative.append((floatToGoString(bound), running))  # type: ignore[no-untyped-call]
        yield HistogramMetricFamily(
            self.name, self.documentation, buckets=cumulative, sum_value=self._sum
        )


METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST

# Label values are bounded: an unknown path must not grow the series set.
_KNOWN = (
    "/forward",
    "/health",
    "/info",
    "/metrics",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",  # the gateway's OpenAI API
)


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
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class ServerMetrics:
    """The metrics of one node or gateway; ``render()`` is the ``/metrics`` body."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._answers: dict[tuple[str, int], _Count] = {}  # see observe_request
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Tally(
            "meshnet_requests",
            "Requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.chunks = Tally(
            "meshnet_chunks",
            "Activation chunks answered, by outcome",
            ["outcome"],
            registry=r,
        )
        # peer: "upstream" (our clients) or "downstream" (our --next/--entry).
        self.bytes_in = Tally(
            "meshnet_body_bytes_in",
            "Activation body bytes received, on the wire",
            ["peer"],
            registry=r,
        )
        self.bytes_out = Tally(
            "meshnet_body_bytes_out",
            "Activation body bytes sent, on the wire",
            ["peer"],
            registry=r,
        )
        self.sessions = Gauge("meshnet_sessions", "Sessions currently held", registry=r)
        self.connections = Gauge("meshnet_connections", "Open client connections", registry=r)
        self.inflight_bytes = Gauge(
            "meshnet_inflight_tensor_bytes",
            "Tensor bytes reserved for requests in flight (--max-inflight-bytes)",
            registry=r,
        )
        self.stage_seconds = TallyHistogram(
            "meshnet_stage_seconds",
            "Stage compute time per chunk",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.codec_seconds = Histogram(
            "meshnet_codec_seconds",
            "Tensor encode/decode time",
            ["op"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )

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
        # The series of a known path and status, remembered (every answer
        # counts one: ~0.5 us a decode step). Only known paths are keys, so
        # a peer's made-up paths cannot grow the memo.
        series = self._answers.get((path, status))
        if series is None:
            label = endpoint_label(path)
            series = self.requests.labels(label, str(status))
            if label == path:
                self._answers[path, status] = series
        series.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
