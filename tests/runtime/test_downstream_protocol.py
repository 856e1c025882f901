"""``Downstream``: what a single node's pool does for the replica-only parts
of the protocol (issue 21 part 3): nothing, so a server never asks which
implementation it holds. Both implementations are checked against the
protocol by mypy where src holds them (``NodeApp.downstream``,
``GatewayApp.pool``)."""

from __future__ import annotations

import anyio
import pytest

from meshnet_proto import WireHeaders
from meshnet_runtime.downstream import Downstream, DownstreamPool
from meshnet_runtime.replicas import ReplicaSet

pytestmark = pytest.mark.anyio

SESSION = "5b1e0c2a-3333-4abc-8def-000000000001"


async def test_a_single_node_has_no_replica_state() -> None:
    pool: Downstream = DownstreamPool("http://127.0.0.1:1")
    assert pool.version == 0 and pool.describe() is None and pool.on_change is None
    headers = WireHeaders(shape=(1, 2), dtype="float32", session=SESSION, chunk_index=0,
                          chunk_total=1, position=0)  # fmt: skip
    pool.record_replayed(SESSION, headers, b"\0" * 8)  # kept nowhere: nothing to fail over to
    pool.forget(SESSION)
    with anyio.fail_after(1):
        await pool.maintain()  # no probes: returns at once
    assert pool.idle_connections == 0
    await pool.aclose()


async def test_a_replica_set_is_a_downstream_too() -> None:
    hop: Downstream = ReplicaSet([DownstreamPool("http://127.0.0.1:1").endpoint])
    assert hop.version == 0 and hop.describe() is not None
    changes: list[int] = []
    hop.on_change = lambda: changes.append(1)
    assert hop.on_change is not None
    await hop.aclose()
