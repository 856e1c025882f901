"""Replica sets in one process (issue 14): the parts the process tests in
test_failover.py do not reach cheaply: the history's bound and the error
of an evicted session, no replica left, DNS membership, the /metrics and
/info views, deep health, the query of a replay, the --next/--entry lists."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshnet_gateway import Client, RemoteError, open_gateway
from meshnet_gateway.config import GatewayConfig
from meshnet_node import RunningNode, serve_node
from meshnet_node.backends import CountingStage, StageContext, echo
from meshnet_node.config import NodeConfig
from meshnet_proto import ActivationHead, DownstreamError, ErrorResponse, WireHeaders
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.endpoints import parse_endpoint
from meshnet_runtime.history import CHUNK_OVERHEAD, HistoryStore
from meshnet_runtime.metrics import ServerMetrics
from meshnet_runtime.replicas import ReplicaSet, needs_replica_set
from support.gateway import QUIET, activation, same_bits
from support.waiting import wait_until

pytestmark = pytest.mark.anyio
FAST = ["--health-interval", "0.1", "--probe-timeout", "1"]


def chunk(session: str, index: int, position: int, tokens: int = 2) -> WireHeaders:
    return WireHeaders(
        shape=(1, tokens, 4), dtype="float32", session=session, chunk_index=index,
        chunk_total=8, position=position,
    )  # fmt: skip


SESSION = "00000000-0000-4000-8000-000000000001"
OTHER = "00000000-0000-4000-8000-000000000002"


def test_history_keeps_position_order_and_evicts_whole_sessions() -> None:
    store = HistoryStore(max_bytes=3 * (100 + CHUNK_OVERHEAD))
    store.add(SESSION, chunk(SESSION, 1, 2), b"b" * 100)
    store.add(SESSION, chunk(SESSION, 0, 0), b"a" * 100)
    store.add(SESSION, chunk(SESSION, 0, 0), b"a" * 100)  # the same chunk: replaced, not doubled
    assert [c.key for c in store.chunks(SESSION)] == [(0, 0, 0), (0, 2, 1)]
    assert [c.key for c in store.chunks(SESSION, before=(0, 2))] == [(0, 0, 0)]
    assert store.nbytes == 2 * (100 + CHUNK_OVERHEAD)
    store.add(OTHER, chunk(OTHER, 0, 0), b"c" * 100)
    store.add(OTHER, chunk(OTHER, 1, 2), b"d" * 100)  # over the bound: the oldest session goes
    assert SESSION not in store and store.evicted(SESSION) and store.chunks(SESSION) == []
    store.add(SESSION, chunk(SESSION, 2, 4), b"e" * 100)  # a gap: nothing kept
    assert SESSION not in store and store.nbytes == 2 * (100 + CHUNK_OVERHEAD)
    store.add(OTHER, chunk(OTHER, 2, 4), b"f" * 10, now=50.0)
    assert store.expire(now=55.0, ttl=10.0) == [] and store.expire(61.0, 10.0) == [OTHER]
    store.forget(SESSION)
    store.forget(OTHER)
    assert not store.evicted(SESSION) and store.nbytes == 0 and len(store) == 0
    with pytest.raises(ValueError):
        HistoryStore(-1)


def test_a_kept_chunk_costs_its_grammar_mask_too() -> None:
    """A sampled chunk's mask (wire-2 §3.13) is held with its headers: in the budget."""
    from meshnet_proto.lowlevel import SampleSpec

    masked = chunk(SESSION, 0, 0).replace(sample=SampleSpec(seed=1, allow=b"\xff" * 6144))
    store = HistoryStore(max_bytes=10**6)
    store.add(SESSION, masked, b"a" * 100)
    assert store.nbytes == 100 + CHUNK_OVERHEAD + 6144


def test_a_replay_query_reaches_the_application() -> None:
    head = ActivationHead(headers=chunk(SESSION, 0, 0), expects_continue=False, query="replay=1")
    assert head.query == "replay=1"
    with pytest.raises(TypeError):
        ActivationHead(headers=chunk(SESSION, 0, 0), expects_continue=False, query=1)  # type: ignore[arg-type]


def test_next_and_entry_take_replica_lists() -> None:
    config = NodeConfig.load(["--next", "http://127.0.0.1:1, http://127.0.0.1:2"])
    assert config.next is not None and config.next.url == "http://127.0.0.1:1"
    assert [e.url for e in config.next_replicas] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    with pytest.raises(SystemExit):
        GatewayConfig.load(["--entry", "http://127.0.0.1:1,"])
    one = (parse_endpoint("http://127.0.0.1:1"),)
    assert not needs_replica_set(one)
    assert needs_replica_set((parse_endpoint("http://replicas.example:80"),))
    assert not needs_replica_set((parse_endpoint("http://localhost:80"),))


@contextlib.asynccontextmanager
async def two_replicas(*flags: str) -> AsyncIterator[tuple[list[RunningNode], RunningNode]]:
    """Two count-backend replicas of the last stage behind one entry node."""
    async with contextlib.AsyncExitStack() as stack:
        lasts = [
            await stack.enter_async_context(
                serve_node(NodeConfig.load([*QUIET, "--backend", "count"]))
            )
            for _ in range(2)
        ]
        urls = ",".join(n.url for n in lasts)
        entry = await stack.enter_async_context(
            serve_node(NodeConfig.load([*QUIET, *FAST, "--next", urls, *flags]))
        )
        yield lasts, entry


def replicas_of(node: RunningNode) -> ReplicaSet:
    assert isinstance(node.app.downstream, ReplicaSet)
    return node.app.downstream


async def test_stopped_replica_fails_over_and_views_show_it() -> None:
    async with two_replicas() as (lasts, entry), Client(entry.url) as client:
        with anyio.fail_after(30):
            first = await client.forward_chunks(activation(8, 4, seed=1), chunk_tokens=2)
            hop = replicas_of(entry)
            holder = next(n for n in lasts if n.url == hop.holder(first.session))
            other = next(n for n in lasts if n is not holder)
            holder.server.request_shutdown()  # 503 shutting_down, then gone
            array = activation(6, 4, seed=2)
            moved = await client.forward_chunks(
                array, session=first.session, position=8, chunk_tokens=2
            )
            assert same_bits(moved.output, array)
            assert hop.holder(first.session) == other.url
            stage = other.app.stage
            assert isinstance(stage, CountingStage)
            assert max(stage.runs.values()) == 1 and sum(stage.runs.values()) == 4 + 3
            info = entry.app.info()["replicas"]
            assert info["failovers"] == 1 and info["replayed"]["tokens"] == 8
            assert info["replayed"]["chunks"] == 4 and info["replayed"]["bytes"] > 0
            families = {
                (s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(entry.app.metrics.render().decode())
                for s in f.samples
            }
            stage_label = ("stage", hop.url)
            assert families[("meshnet_failovers_total", (stage_label,))] == 1
            assert families[("meshnet_replayed_total", (stage_label, ("unit", "tokens")))] == 8
            assert families[("meshnet_replica_up", (("replica", other.url), stage_label))] == 1
            sessions = ("meshnet_replica_sessions", (("replica", other.url), stage_label))
            assert families[sessions] == 1
            # The session ends on every replica; the entry forgets its history.
            assert await client.delete_session(first.session)
            assert len(other.app.table) == 0 and len(hop.history) == 0


async def test_deep_health_degraded_then_down_and_no_replica_left() -> None:
    async with two_replicas() as (lasts, entry), Client(entry.url) as client:
        hop = replicas_of(entry)
        with anyio.fail_after(30):
            health = await client.pool.request("GET", "/health?deep=1", Deadline.after(10))
            assert b'"status":"ok"' in health.body
            lasts[0].server.request_shutdown()
            await wait_until(lambda: not hop.replicas[0].up, "its probe sees it go")
            health = await client.pool.request("GET", "/health?deep=1", Deadline.after(10))
            assert b'"status":"degraded"' in health.body
            lasts[1].server.request_shutdown()
            await wait_until(lambda: not hop.replicas[1].up, "its probe sees it go")
            health = await client.pool.request("GET", "/health?deep=1", Deadline.after(10))
            assert isinstance(health, ErrorResponse) and health.status == 502
            assert health.error["code"] == "stage_down"
            with pytest.raises(RemoteError) as caught:
                await client.forward_chunks(activation(4, 4, seed=3), chunk_tokens=2)
            assert caught.value.code == "no_replica" and caught.value.hop == hop.url


async def test_an_evicted_history_is_a_clear_error_naming_the_stage() -> None:
    # Room for one chunk's history only: a 4-chunk session loses its own.
    flags = ("--max-history-bytes", "1024")
    async with two_replicas(*flags) as (lasts, entry), Client(entry.url) as client:
        if True:  # one level, as in the other tests
            with anyio.fail_after(30):
                first = await client.forward_chunks(activation(8, 4, seed=1), chunk_tokens=2)
                hop = replicas_of(entry)
                assert hop.history.evicted(first.session)
                holder = next(n for n in lasts if n.url == hop.holder(first.session))
                holder.server.request_shutdown()
                with pytest.raises(RemoteError) as caught:
                    await client.forward_chunks(
                        activation(2, 4, seed=2), session=first.session, position=8,
                        chunk_tokens=2,
                    )  # fmt: skip
                assert caught.value.code == "session_lost" and caught.value.hop == hop.url
                assert "evicted" in caught.value.message


async def test_a_gateway_entry_replica_set_resolves_names() -> None:
    async with contextlib.AsyncExitStack() as stack:
        node = await stack.enter_async_context(
            serve_node(NodeConfig.load([*QUIET, "--backend", "count"]))
        )
        port = int(node.url.rsplit(":", 1)[1])
        answers = {"replicas.test": ["127.0.0.1"]}

        async def resolver(host: str, _port: int) -> list[str]:
            if host not in answers:
                raise OSError("no such name")
            return answers[host]

        named = parse_endpoint(f"http://replicas.test:{port}")
        hop = ReplicaSet([named], metrics=ServerMetrics("gateway"), resolver=resolver)
        try:
            assert hop.replicas == []
            await hop.resolve()
            assert [r.url for r in hop.replicas] == [node.url]
            deadline = Deadline.after(10)
            array = activation(2, 4, seed=1)
            headers = WireHeaders.for_array(array, session=SESSION, chunk_index=0,
                                            chunk_total=1, position=0)  # fmt: skip
            answer = await hop.forward(headers, array.tobytes(), deadline)
            assert answer.headers.session == SESSION
            answers["replicas.test"] = []  # the address left the name
            await hop.resolve()
            assert hop.replicas[0].retired
            del answers["replicas.test"]  # resolution fails: membership stays
            await hop.resolve()
            assert len(hop.replicas) == 1
        finally:
            await hop.aclose()


async def test_gateway_entry_replicas_show_in_info() -> None:
    async with two_replicas() as (lasts, entry):
        urls = ",".join(n.url for n in lasts)
        config = GatewayConfig.load([*QUIET, *FAST, "--entry", urls])
        async with open_gateway(config) as gateway, Client(gateway.url) as client:
            with anyio.fail_after(30):
                await client.forward(activation(4, 4, seed=1))
                info = await client.info()
                assert info["entry"] == urls
                assert [r["url"] for r in info["replicas"]["replicas"]] == urls.split(",")
                assert sum(r["sessions"] for r in info["replicas"]["replicas"]) == 1
                with pytest.raises(DownstreamError):
                    raise replicas_of(entry)._none_left(SESSION)


@dataclass(slots=True, eq=False)
class DrainAfter(CountingStage):
    """``--backend count`` that has its node start draining (``drain``) right
    after its ``after``-th chunk: mid-run on any machine, not after a sleep."""

    after: int = 0
    drain: Callable[[], None] | None = None

    async def __call__(self, tensor: np.ndarray, context: StageContext | None = None) -> np.ndarray:
        out = await CountingStage.__call__(self, tensor, context)
        if self.drain is not None and sum(self.runs.values()) == self.after:
            self.drain()
        return out


async def test_a_run_with_chunks_in_flight_fails_over_mid_run() -> None:
    """--inflight 4 over two entry replicas: the holder starts draining in
    the middle of a 12-chunk run (its chunks in flight finish, later ones
    get 503 shutting_down). The other replica is given the chunks done so
    far and the rest; the answer is bit-exact and no chunk runs twice."""
    async with contextlib.AsyncExitStack() as stack:
        nodes = [
            await stack.enter_async_context(
                serve_node(NodeConfig.load(QUIET), stage=DrainAfter("count", echo, 20.0))
            )
            for _ in range(2)
        ]
        urls = ",".join(n.url for n in nodes)
        config = GatewayConfig.load([*QUIET, *FAST, "--entry", urls, "--inflight", "4",
                                         "--chunk-tokens", "2"])  # fmt: skip
        gateway = await stack.enter_async_context(open_gateway(config))
        client = await stack.enter_async_context(Client(gateway.url))
        hop = gateway.app.pool
        assert isinstance(hop, ReplicaSet)
        with anyio.fail_after(30):
            first = await client.forward(activation(2, 4, seed=1), encoding="identity")
            holder = next(n for n in nodes if n.url == hop.holder(first.session))
            other = next(n for n in nodes if n is not holder)
            array = activation(24, 4, seed=2)
            draining = holder.app.stage
            assert isinstance(draining, DrainAfter)
            draining.after, draining.drain = 1 + 4, holder.server.request_shutdown  # 4 of 12 run
            result = await client.forward(array, session=first.session, encoding="identity")
            assert holder.server.draining
            assert same_bits(result.output, array)
            assert hop.holder(first.session) == other.url and hop.failovers == 1
            stage = other.app.stage
            assert isinstance(stage, CountingStage)
            assert max(stage.runs.values()) == 1
            assert sum(stage.runs.values()) == 1 + 12  # chunk 0 of the first run + all 12


async def test_a_replica_only_its_probes_call_down_is_the_last_resort() -> None:
    """A probe can time out on a slow but healthy replica. When the other
    replica is really gone, the session goes on there rather than failing."""
    async with two_replicas() as (lasts, entry), Client(entry.url) as client:
        hop = replicas_of(entry)
        with anyio.fail_after(30):
            first = await client.forward_chunks(activation(4, 4, seed=1), chunk_tokens=2)
            holder = next(r for r in hop.replicas if r.url == hop.holder(first.session))
            gone = next(n for n in lasts if n.url != holder.url)
            gone.server.request_shutdown()
            holder.mark_down(anyio.current_time(), 1000.0)  # no probe for a long while
            array = activation(2, 4, seed=2)
            result = await client.forward_chunks(
                array, session=first.session, position=4, chunk_tokens=2
            )
            assert same_bits(result.output, array) and hop.holder(first.session) == holder.url


async def test_a_replica_holding_a_stale_copy_is_cleared_then_replayed() -> None:
    """A session moves from replica A to B (A only marked down: it keeps its
    copy), then back to A. A replay can never rewrite a live session (wire-2
    §3.9): A answers the replay's first chunk 409 session_exists, so the set
    DELETEs A's stale copy, with the session's key, and replays once more.
    The session goes on bit-exact at its position, A rebuilt from the start."""
    async with two_replicas() as (lasts, entry), Client(entry.url) as client:
        hop = replicas_of(entry)
        with anyio.fail_after(30):
            first = await client.forward_chunks(activation(4, 4, seed=1), chunk_tokens=2)
            session = first.session
            a = next(r for r in hop.replicas if r.url == hop.holder(session))
            b = next(r for r in hop.replicas if r is not a)
            node_a = next(n for n in lasts if n.url == a.url)
            a.mark_down(anyio.current_time(), 1000.0)  # no probe brings it back meanwhile
            array = activation(2, 4, seed=2)
            moved = await client.forward_chunks(array, session=session, position=4, chunk_tokens=2)
            assert same_bits(moved.output, array) and hop.holder(session) == b.url
            assert node_a.app.table.position(session) == 4  # the stale copy A still holds
            b.mark_down(anyio.current_time(), 1000.0)
            a.mark_up()
            array = activation(2, 4, seed=3)
            back = await client.forward_chunks(array, session=session, position=6, chunk_tokens=2)
        assert same_bits(back.output, array) and hop.holder(session) == a.url
        assert hop.failovers == 2
        assert node_a.app.table.position(session) == 8
        stage = node_a.app.stage
        assert isinstance(stage, CountingStage)
        # Its first chunks ran again (the copy was rebuilt, not kept), the rest once.
        assert stage.runs[(session, 0, 0)] == 2 and stage.runs[(session, 1, 2)] == 2
        assert stage.runs[(session, 0, 4)] == 1 and stage.runs[(session, 0, 6)] == 1
        # A's copy is still the owner's: a DELETE with another key is refused there.
        async with Client(node_a.url) as stranger:
            with pytest.raises(RemoteError) as refused:
                await stranger.delete_session(session, key="0" * 32)
        assert (refused.value.status, refused.value.code) == (403, "session_forbidden")
        assert await client.delete_session(session)
        assert session not in node_a.app.table
