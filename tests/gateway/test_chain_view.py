"""The gateway's ``/info`` ``stages``: the chain in one view (issue 22, "Why" 7).

Before, a gateway's ``/info`` showed its entry URL only and deep health only
roles: which node held which layers, on which engine, and which one was
down could not be seen from the front door. Here ``/info`` is read as a
client reads it (over HTTP) and must list every stage in order with its
replicas' URLs, layers, engine, dtype, health and load — and stay a 200,
bounded, when a hop is gone, silent, or the chain is deeper than the limit.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import meshnet_gateway.chain_view as chain_view
import meshnet_runtime.control as control
from meshnet_gateway import Client, open_gateway
from meshnet_gateway.config import GatewayConfig
from meshnet_node import serve_node
from meshnet_node.config import NodeConfig
from meshnet_proto import ActivationResponse, WireHeaders
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool
from support.gateway import QUIET, chain, closed_port_url
from support.openai import serve_openai, write_model_dir
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

LIMIT = 60  # seconds: only ends a hung test


async def info(url: str) -> dict[str, Any]:
    with anyio.fail_after(LIMIT):
        async with Client(url) as client:
            return await client.info()


@asynccontextmanager
async def gateway_over_node_to(next_url: str) -> AsyncIterator[str]:
    """A gateway in front of one echo node whose ``--next`` is ``next_url``."""
    async with (
        serve_node(NodeConfig.load([*QUIET, "--next", next_url])) as entry,
        open_gateway(GatewayConfig.load([*QUIET, "--entry", entry.url])) as gateway,
    ):
        yield gateway.url


async def test_every_stage_in_order_with_layers_engine_dtype_health_and_load(
    tmp_path: Path,
) -> None:
    model_dir = write_model_dir(tmp_path / "tiny")
    async with serve_openai(model_dir, stages=2) as served:
        document = await info(served.url)
    stages = document["stages"]
    assert [s["stage"] for s in stages] == [0, 1]
    assert [[r["url"] for r in s["replicas"]] for s in stages] == [[u] for u in served.node_urls]
    rows = [s["replicas"][0] for s in stages]
    assert [r["layers"] for r in rows] == [[0, 2], [2, 4]]
    for row in rows:
        assert (row["health"], row["role"], row["backend"]) == ("ok", "node", "model")
        assert (row["engine"], row["dtype"], row["model"]) == ("numpy", "float32", "tiny")
        assert row["weights"] == "float32"  # numpy holds the matrices as float32
        assert row["sessions"] == 0 and row["kv_sessions"] == 0
    assert document["walk"]["complete"] is True and document["walk"]["stopped"] is None


async def test_a_replica_set_entry_shows_each_replica_and_the_hops_view() -> None:
    """``--entry a,b``: both replicas of stage 0, with the in-flight count the
    gateway's replica set keeps, then the stage below."""
    async with serve_node(NodeConfig.load(QUIET)) as last:
        below = [*QUIET, "--next", last.url]
        async with serve_node(NodeConfig.load(below)) as a, serve_node(NodeConfig.load(below)) as b:
            flags = [*QUIET, "--entry", f"{a.url},{b.url}"]
            async with open_gateway(GatewayConfig.load(flags)) as gateway:
                document = await info(gateway.url)
    first, second = document["stages"]
    assert sorted(r["url"] for r in first["replicas"]) == sorted([a.url, b.url])
    for row in first["replicas"]:
        assert (row["health"], row["inflight"], row["backend"]) == ("ok", 0, "echo")
    assert [r["url"] for r in second["replicas"]] == [last.url]
    assert second["replicas"][0]["inflight"] == 0  # a single node: its own count


async def test_a_single_nodes_load_is_its_own_count_of_chunks_in_flight() -> None:
    """A node behind a plain ``--next`` (no replica set above it counts for
    it) says in ``/info`` how many chunks it has admitted and not answered."""
    async with serve_node(NodeConfig.load([*QUIET, "--delay-ms", "3000"])) as slow:
        array = np.zeros((1, 1, 8), dtype=np.float32)
        headers = WireHeaders.for_array(array, session="5b1e0c2a-1111-4abc-8def-000000000009",
                                        chunk_index=0, chunk_total=1)  # fmt: skip
        answers: list[object] = []
        pool = DownstreamPool(slow.url)
        try:
            async with anyio.create_task_group() as tg:

                async def send() -> None:
                    deadline = Deadline.after(LIMIT)
                    answers.append(await pool.forward(headers, array.tobytes(), deadline))

                tg.start_soon(send)

                async def in_flight() -> bool:
                    return (await info(slow.url))["inflight"] == 1

                await wait_until(in_flight, "the chunk in flight", timeout=LIMIT, every=0.05)
        finally:
            await pool.aclose()
        assert isinstance(answers[0], ActivationResponse)
        assert (await info(slow.url))["inflight"] == 0


async def test_a_hop_that_is_gone_is_shown_unreachable_and_info_stays_200() -> None:
    down = closed_port_url()
    async with gateway_over_node_to(down) as url:
        document = await info(url)  # a 200: info() raises on any error answer
    first, gone = document["stages"]
    assert first["replicas"][0]["health"] == "ok"
    row = gone["replicas"][0]
    assert (row["url"], row["health"]) == (down, "unreachable")
    assert "cannot connect" in row["error"]
    assert document["walk"]["complete"] is False
    assert "no replica of stage 1 answered" in document["walk"]["stopped"]


@pytest.fixture
def silent_url() -> Iterator[str]:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


async def test_a_silent_hop_costs_the_hop_timeout_not_a_hang(
    silent_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chain_view, "HOP_TIMEOUT", 0.5)
    # The gateway's start-up chain check (deep health through the entry)
    # would wait its 10 s for the silent hop first; this test is the view's.
    monkeypatch.setattr(control, "HEALTH_TIMEOUT", 0.5)
    async with gateway_over_node_to(silent_url) as url:
        document = await info(url)
    row = document["stages"][1]["replicas"][0]
    assert row["url"] == silent_url and row["health"] == "unreachable"
    assert row["error"] == "no answer within 0.5 s"
    assert document["walk"]["hop_timeout_s"] == 0.5


async def test_the_walk_stops_at_the_depth_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chain_view, "MAX_STAGES", 2)
    async with chain(3) as served:
        document = await info(served.gateway.url)
    assert [s["replicas"][0]["url"] for s in document["stages"]] == [
        n.url for n in served.nodes[:2]
    ]
    assert document["walk"]["complete"] is False
    assert document["walk"]["stopped"].startswith("more than 2 stages")
