"""The multi-host chain (tests/test_multihost.py) with a replicated last
stage: node 1's ``--next`` names two hosts. Cutting the link to the replica
holding the session (packets vanish: no reset, no ICMP) mid-session does
not fail the session: node 1's probes find the replica gone, the session
moves to the other host with its history replayed, and the answers stay
bit-exact. Needs root and iproute2 (skipped, with the reason, otherwise)."""

from __future__ import annotations

import json

import anyio
import pytest

from meshnet_bench._netns import hosts, unavailable
from meshnet_gateway import Client
from meshnet_runtime.deadlines import Deadline
from support.gateway import activation, same_bits

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"multi-host chain: {REASON}")

HEALTH = ["--health-interval", "0.3", "--probe-timeout", "1.5"]


def test_cutting_the_link_to_the_replica_in_use_moves_the_session() -> None:
    with hosts(["gw", "n1", "n2a", "n2b"]) as net:
        _, n2a = net.spawn("n2a", "meshnet_node", "--port", "8000", "--backend", "count")
        _, n2b = net.spawn("n2b", "meshnet_node", "--port", "8000", "--backend", "count")
        _, n1 = net.spawn("n1", "meshnet_node", "--port", "8000", "--next", f"{n2a},{n2b}",
                          *HEALTH)  # fmt: skip
        _, gateway = net.spawn("gw", "meshnet_gateway", "--port", "8000", "--entry", n1,
                               "--timeout", "15", "--chunk-tokens", "16")  # fmt: skip
        host_of = {n2a: "n2a", n2b: "n2b"}

        async def drive() -> None:
            async with Client(gateway) as client, Client(n1) as entry:
                with anyio.fail_after(60):
                    first = await client.forward(activation(64, 32, seed=1), encoding="identity")
                    hop = (await entry.info())["replicas"]
                    (holder,) = [r["url"] for r in hop["replicas"] if r["sessions"]]
                    net.cut(host_of[holder])
                    array = activation(64, 32, seed=2)
                    moved = await client.forward(array, session=first.session, encoding="identity")
                    assert same_bits(moved.output, array)
                    hop = (await entry.info())["replicas"]
                    assert hop["failovers"] == 1 and hop["replayed"]["chunks"] == 4, hop
                    (other,) = [u for u in (n2a, n2b) if u != holder]
                    survivor = (await Client(other).info())["stage"]
                    # The survivor ran the replayed chunks and the new ones, each once.
                    assert survivor["max_runs_per_chunk"] == 1 and survivor["runs"] == 8
                    answer = await entry.pool.request("GET", "/health?deep=1", Deadline.after(10))
                    health = json.loads(answer.body)
                    assert health["status"] == "degraded", health
                net.restore(host_of[holder])

        anyio.run(drive, backend="trio")
