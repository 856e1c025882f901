"""What one request cost on each hop of ``meshnet demo``'s chain, read from
the servers' own ``/metrics`` (nothing is counted here).

Each node counts the activation bodies it takes from its upstream peer and
answers back (``meshnet_body_bytes_in/out{peer="upstream"}``), the chunks it
answered (``meshnet_chunks``) and its stage's compute time
(``meshnet_stage_seconds``); the gateway counts the generation's tokens and
its time to the first token and decode time (the vLLM-named series). A
snapshot before the request and one after give that request's share: the
counters are cumulative, and the chain check at the gateway's start made
requests of its own.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
from prometheus_client.parser import text_string_to_metric_families

from .demo import table

__all__ = ["Snapshot", "Traffic", "hop_lines", "rate_line", "snapshot"]

# One sample: its name and its labels, sorted (a hashable key).
_Key = tuple[str, tuple[tuple[str, str], ...]]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every server's samples at one moment: the gateway's, then each node's."""

    gateway: dict[_Key, float]
    nodes: list[dict[_Key, float]]


def _scrape(url: str) -> dict[_Key, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode("utf-8")
    samples: dict[_Key, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


async def snapshot(gateway: str, nodes: Sequence[str]) -> Snapshot:
    """``/metrics`` of the gateway and of every node, entry first (urllib in
    a worker thread: the servers answer on this event loop)."""
    scraped = [await anyio.to_thread.run_sync(_scrape, url) for url in (gateway, *nodes)]
    return Snapshot(scraped[0], scraped[1:])


def _total(samples: dict[_Key, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and wanted <= set(lab))


@dataclass(frozen=True, slots=True)
class Traffic:
    """What happened between two snapshots."""

    before: Snapshot
    after: Snapshot

    def node(self, index: int, name: str, **labels: str) -> float:
        return _total(self.after.nodes[index], name, **labels) - _total(
            self.before.nodes[index], name, **labels
        )

    def gateway(self, name: str) -> float:
        return _total(self.after.gateway, name) - _total(self.before.gateway, name)


def hop_lines(traffic: Traffic, splits: Sequence[tuple[int, int]]) -> list[str]:
    """A row a hop: who sent to whom, the chunks the receiving node answered,
    the bytes each way and the node's compute time (per chunk too)."""
    rows = [["hop", "chunks", "bytes up", "bytes down", "node compute", "per chunk"]]
    for index, (start, end) in enumerate(splits):
        sender = "gateway" if index == 0 else f"node {index}"
        chunks = int(traffic.node(index, "meshnet_chunks_total"))
        seconds = traffic.node(index, "meshnet_stage_seconds_sum")
        rows.append(
            [
                f"{sender} -> node {index + 1} (layers {start}:{end})",
                f"{chunks:,}",
                f"{int(traffic.node(index, 'meshnet_body_bytes_in_total', peer='upstream')):,}",
                f"{int(traffic.node(index, 'meshnet_body_bytes_out_total', peer='upstream')):,}",
                f"{seconds:.2f} s",
                f"{seconds / chunks * 1000:.1f} ms" if chunks else "-",
            ]
        )
    return table(rows, right=set(range(1, len(rows[0]))), rule=False)


def rate_line(traffic: Traffic) -> str:
    """``8 tokens in 0.61 s: the first after 0.20 s, then 17.1 tok/s`` — the
    gateway's own timing (as its access line computes it: the decode rate is
    the tokens after the first over the time after the first)."""
    tokens = int(traffic.gateway("meshnet_generation_tokens_total"))
    first = traffic.gateway("meshnet_time_to_first_token_seconds_sum")
    decode = traffic.gateway("meshnet_request_decode_time_seconds_sum")
    whole = traffic.gateway("meshnet_e2e_request_latency_seconds_sum")
    line = f"{tokens} tokens in {whole:.2f} s: the first after {first:.2f} s"
    if tokens >= 2 and decode > 0:
        line += f", then {(tokens - 1) / decode:.1f} tok/s"
    return line
