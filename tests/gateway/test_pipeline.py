"""The gateway and the client API over real loopback sockets, on trio and asyncio.

Nodes and gateway run in-process (``serve_node``, ``open_gateway``); the
subprocess tests are in ``tests/gateway/test_process.py``.
"""

from __future__ import annotations

import contextlib
import secrets
import uuid

import anyio
import anyio.abc
import ml_dtypes
import numpy as np
import pytest

from meshnet_gateway import (
    Client,
    RemoteError,
    delete_session,
    forward_via_chain,
    forward_via_gateway,
    open_gateway,
)
from meshnet_gateway.config import GatewayConfig
from meshnet_gateway.entry import reorder_window
from meshnet_node import serve_node
from meshnet_node.config import NodeConfig
from meshnet_proto import DownstreamError, MeshnetError
from support.gateway import (
    QUIET,
    activation,
    chain,
    chunks_counted,
    closed_port_url,
    release_port,
    same_bits,
)
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

# Every wait in this file is bounded: a hang fails the test, never the run.
LIMIT = 20


@pytest.mark.parametrize("encoding", ["zstd", "identity"])
async def test_story_512_tokens_in_4_chunks_through_two_nodes(encoding: str) -> None:
    """US-011's integration test: all 4 chunk responses, with correct headers."""
    array = activation(512, 256)
    session = str(uuid.uuid4())
    async with chain(2) as c:
        with anyio.fail_after(LIMIT):
            result = await forward_via_chain(
                c.entry, array, session=session, chunk_tokens=128, encoding=encoding
            )
    assert len(result.chunk_headers) == 4
    for index, headers in enumerate(result.chunk_headers):
        assert headers.shape == (1, 128, 256)
        assert headers.dtype == "bfloat16"
        assert headers.session == session
        assert headers.chunk_index == index
        assert headers.chunk_total == 4
        assert headers.encoding == encoding
        assert headers.position == 128 * index
    assert same_bits(result.output, array)
    assert result.session == session and result.position == 0
    assert result.headers.shape == (1, 512, 256)


async def test_gateway_echo_is_bit_exact_and_makes_a_session() -> None:
    array = activation(300, 64)  # 3 chunks: 128, 128, 44
    async with chain(2) as c:
        with anyio.fail_after(LIMIT):
            result = await forward_via_gateway(c.gateway.url, array)
        assert chunks_counted(c.nodes[0].app, "processed") == 3
    assert same_bits(result.output, array)
    assert uuid.UUID(result.session).version == 4
    headers = result.headers
    assert (headers.shape, headers.dtype, headers.encoding) == ((1, 300, 64), "bfloat16", "zstd")
    assert (headers.chunk_index, headers.chunk_total, headers.position) == (0, 1, 0)


async def test_gateway_zeros_backend_answers_zeros() -> None:
    array = activation(200, 32).astype(np.float32)
    async with chain(2, last_flags=["--backend", "zeros"]) as c:
        with anyio.fail_after(LIMIT):
            result = await forward_via_gateway(c.gateway.url, array, encoding="identity")
    assert result.output.dtype == np.float32 and result.output.shape == array.shape
    assert not result.output.any()
    assert result.headers.encoding == "identity"


async def test_three_node_chain_rank_1_and_rank_3_int32() -> None:
    tokens = np.arange(1000, dtype=np.int32)  # rank 1: the token axis is axis 0
    batch = np.arange(2 * 260 * 8, dtype=np.int32).reshape(2, 260, 8)  # strided chunk views
    async with chain(3, gateway_flags=["--chunk-tokens", "100"]) as c:
        with anyio.fail_after(LIMIT):
            first = await forward_via_gateway(c.gateway.url, tokens)
            second = await forward_via_gateway(c.gateway.url, batch)
        assert all(chunks_counted(n.app, "processed") == 13 for n in c.nodes)
    assert np.array_equal(first.output, tokens) and first.output.dtype == np.int32
    assert np.array_equal(second.output, batch)


async def test_inflight_4_is_bit_identical_to_inflight_1() -> None:
    array = activation(1024, 64, seed=3)
    outputs = []
    for inflight in ("1", "4"):
        flags = ["--inflight", inflight, "--chunk-tokens", "64"]
        async with chain(3, node_flags=["--delay-ms", "5"], gateway_flags=flags) as c:
            assert c.gateway.app.inflight == int(inflight)
            with anyio.fail_after(LIMIT):
                outputs.append(await forward_via_gateway(c.gateway.url, array))
    assert same_bits(outputs[0].output, outputs[1].output)
    assert same_bits(outputs[1].output, array)


async def test_inflight_is_capped_at_the_entryreorder_window() -> None:
    async with chain(2, node_flags=["--reorder-window", "2"],
                     gateway_flags=["--inflight", "8"]) as c:  # fmt: skip
        assert c.gateway.app.inflight == 2
        async with Client(c.gateway.url) as client:
            info = await client.info()
        assert info["inflight"] == {"configured": 8, "entry_reorder_window": 2, "effective": 2}
        with anyio.fail_after(LIMIT):
            result = await forward_via_gateway(c.gateway.url, activation(640, 16))
        assert same_bits(result.output, activation(640, 16))


async def test_chain_client_with_inflight_and_continuation() -> None:
    array = activation(512, 32)
    async with chain(2) as c:
        with anyio.fail_after(LIMIT):
            first = await forward_via_chain(c.entry, array, chunk_tokens=100, inflight=4)
            second = await forward_via_chain(
                c.entry,
                array[:, :50],
                session=first.session,
                position=512,
                chunk_tokens=100,
                key=first.key,
            )
    assert same_bits(first.output, array)
    assert [h.position for h in first.chunk_headers] == [0, 100, 200, 300, 400, 500]
    assert second.chunk_headers[0].position == 512
    assert same_bits(second.output, array[:, :50])


async def test_session_continuation_positions_add_up() -> None:
    array = activation(200, 16)
    async with chain(2) as c, Client(c.gateway.url) as client:
        with anyio.fail_after(LIMIT):
            first = await client.forward(array)
            second = await client.forward(array[:, :72], session=first.session)
            third = await client.forward(array[:, :1], session=first.session, position=272)
        node_position = c.nodes[1].app.table.position(first.session)
    assert (first.position, second.position, third.position) == (0, 200, 272)
    assert second.session == third.session == first.session
    assert node_position == 273
    assert same_bits(second.output, array[:, :72])


async def test_position_the_gateway_does_not_expect_is_409_and_keeps_the_session() -> None:
    array = activation(10, 8)
    async with chain(2) as c, Client(c.gateway.url) as client:
        with anyio.fail_after(LIMIT):
            first = await client.forward(array)
            with pytest.raises(RemoteError) as caught:
                await client.forward(array, session=first.session, position=3)
            assert (caught.value.status, caught.value.code) == (409, "position_mismatch")
            assert caught.value.header == "x-meshnet-position" and caught.value.hop is None
            again = await client.forward(array, session=first.session)
    assert again.position == 10


async def test_concurrent_request_on_one_session_is_409_session_busy() -> None:
    array = activation(256, 8)
    session = str(uuid.uuid4())
    key = secrets.token_hex(16)  # the client's own: bound when the session is made
    async with chain(2, node_flags=["--delay-ms", "80"]) as c:
        results: list[object] = []

        async def slow() -> None:
            results.append(
                await forward_via_gateway(c.gateway.url, array, session=session, key=key)
            )

        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(slow)
                await wait_until(
                    lambda: session in c.gateway.app.sessions, "the first request holds the session"
                )
                with pytest.raises(RemoteError) as caught:
                    await forward_via_gateway(c.gateway.url, array[:, :1], session=session, key=key)
        assert (caught.value.status, caught.value.code) == (409, "session_busy")
        assert caught.value.header == "x-meshnet-session"
        assert same_bits(results[0].output, array)  # type: ignore[attr-defined]
        # The busy answer did not disturb the session: it continues at 256.
        with anyio.fail_after(LIMIT):
            after = await forward_via_gateway(c.gateway.url, array[:, :1], session=session, key=key)
        assert after.position == 256


async def test_failed_chunk_answers_the_error_and_deletes_the_session_down_the_chain() -> None:
    """The nodes know the session at 128, unkeyed; the gateway (as after a
    restart) does not, so its chunk 0 is refused by node 1 (it carries a key
    the session never had: 403): the gateway relays the refusal and forgets
    the session. Its DELETE down the chain carries its key, which is not the
    session's: the owner's session lives on (wire-2 §3.9)."""
    array = activation(256, 16)
    session = str(uuid.uuid4())
    async with chain(2) as c:
        with anyio.fail_after(LIMIT):
            owner_key = secrets.token_hex(16)
            await forward_via_chain(
                c.entry, activation(128, 16, seed=99), session=session, key=owner_key
            )
            assert all(session in n.app.table for n in c.nodes)
            with pytest.raises(RemoteError) as caught:
                await forward_via_gateway(c.gateway.url, array, session=session)
            assert (caught.value.status, caught.value.code) == (403, "session_forbidden")
            assert caught.value.hop == c.entry  # the entry refused; hop names it
            assert session not in c.gateway.app.sessions
            refused = {"endpoint": "/sessions", "status": "403"}
            registry = c.nodes[0].app.metrics.registry
            await wait_until(
                lambda: registry.get_sample_value("meshnet_requests_total", refused) == 1,
                "the background DELETE refused at the entry",
            )
            assert all(n.app.table.position(session) == 128 for n in c.nodes)
            # The owner's own DELETE ends it everywhere.
            assert await delete_session(c.entry, session, key=owner_key)
        assert not any(session in n.app.table for n in c.nodes)


async def test_failure_at_the_last_node_names_it_and_cancels_the_rest() -> None:
    # The last node refuses every tensor over 1 KiB: chunk 0 already fails
    # there, after node 1 ran its stage.
    array = activation(512, 64)
    async with chain(2, last_flags=["--max-tensor-bytes", "1024"],
                     gateway_flags=["--inflight", "4"]) as c:  # fmt: skip
        last = c.nodes[1].url
        with anyio.fail_after(LIMIT), pytest.raises(RemoteError) as caught:
            await forward_via_gateway(c.gateway.url, array)
        assert (caught.value.status, caught.value.code, caught.value.hop) == (
            413,
            "tensor_too_large",
            last,
        )
        await wait_until(
            lambda: len(c.nodes[0].app.table) == 0, "the session deleted", timeout=LIMIT
        )
        assert len(c.gateway.app.sessions) == 0


async def test_entry_down_is_502_naming_it_not_a_hang() -> None:
    down = closed_port_url()
    async with (
        serve_node(NodeConfig.load(["--port", "0", "--log-level", "warning"])) as node,
        chain(1) as c,
    ):
        # A gateway whose entry is down, and a node whose --next is down.
        flags = ["--port", "0", "--entry", down, "--log-level", "error"]
        async with open_gateway(GatewayConfig.load(flags)) as gateway:
            with anyio.fail_after(LIMIT), pytest.raises(MeshnetError) as caught:
                await forward_via_gateway(gateway.url, activation(10, 4))
            assert (caught.value.status, caught.value.code) == (502, "downstream_unreachable")
            assert caught.value.hop == down
            assert gateway.app.info()["inflight"]["entry_reorder_window"] is None
        del node
        nexted = NodeConfig.load(["--port", "0", "--next", down, "--log-level", "error"])
        async with serve_node(nexted) as entry:
            flags = ["--port", "0", "--entry", entry.url, "--log-level", "error"]
            async with open_gateway(GatewayConfig.load(flags)) as gateway:
                with anyio.fail_after(LIMIT), pytest.raises(RemoteError) as caught:
                    await forward_via_gateway(gateway.url, activation(10, 4))
                assert (caught.value.status, caught.value.hop) == (502, down)
        assert c.gateway.app.inflight == 1


async def test_entry_that_accepts_but_never_answers_is_504_within_the_budget() -> None:
    """wire-2 §4: a stopped process still accepts TCP connections; only the
    deadline (the gateway's --timeout) detects it, and names the hop."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    hung = f"http://127.0.0.1:{port}"
    held: list[object] = []

    async def hold(stream: anyio.abc.SocketStream) -> None:
        held.append(stream)  # never read, never answer, never close
        await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, hold)
        flags = ["--port", "0", "--entry", hung, "--timeout", "0.8", "--log-level", "error"]
        async with open_gateway(GatewayConfig.load(flags)) as gateway:
            with anyio.fail_after(LIMIT), pytest.raises(RemoteError) as caught:
                await forward_via_gateway(gateway.url, activation(10, 4))
            assert (caught.value.status, caught.value.code) == (504, "downstream_timeout")
            assert caught.value.hop == hung
            assert held  # the hop was reached and held the request: the deadline ended it
        tg.cancel_scope.cancel()
    await listener.aclose()


async def test_entry_window_is_learnt_once_the_entry_comes_up() -> None:
    down = closed_port_url()
    flags = ["--port", "0", "--entry", down, "--inflight", "4", "--log-level", "error"]
    async with open_gateway(GatewayConfig.load(flags)) as gateway:
        assert gateway.app.inflight == 1  # unknown window: one chunk at a time
        port = release_port(down)  # the entry comes up where the gateway expects it
        node_flags = ["--port", port, "--reorder-window", "3", "--log-level", "warning"]
        async with serve_node(NodeConfig.load(node_flags)):
            with anyio.fail_after(LIMIT):
                result = await forward_via_gateway(gateway.url, activation(300, 8))
                # the /info question runs in the background
                await wait_until(lambda: gateway.app.entry_info_read, "the entry's /info read")
            assert same_bits(result.output, activation(300, 8))
            assert gateway.app.inflight == 3


async def test_client_to_a_closed_port_raises_downstream_error() -> None:
    down = closed_port_url()
    with anyio.fail_after(LIMIT), pytest.raises(DownstreamError) as caught:
        await forward_via_chain(down, activation(10, 4))
    assert caught.value.hop == down and caught.value.status == 502


async def test_deadline_spent_at_the_gateway_is_504() -> None:
    async with chain(2, last_flags=["--delay-ms", "1200"],
                     gateway_flags=["--timeout", "0.4"]) as c:  # fmt: skip
        with anyio.fail_after(LIMIT), pytest.raises(MeshnetError) as caught:
            await forward_via_gateway(c.gateway.url, activation(10, 4))
        assert caught.value.status == 504
        assert caught.value.hop in (c.nodes[1].url, c.nodes[0].url)


async def test_wire_dtype_policy_applies_to_the_whole_run() -> None:
    # float32 values exact in bfloat16 for the first chunk only: auto-lossless
    # must pick one dtype for the whole run (float32), not bfloat16 then float32.
    array = np.ones((1, 256, 8), dtype=np.float32)
    array[:, 200:] = 1.0 + 2.0**-20
    async with chain(2, gateway_flags=["--wire-dtype", "auto-lossless"]) as c:
        with anyio.fail_after(LIMIT):
            result = await forward_via_gateway(c.gateway.url, array)
            small = await forward_via_gateway(c.gateway.url, array[:, :128])
    assert result.output.dtype == np.float32 and np.array_equal(result.output, array)
    assert small.output.dtype == ml_dtypes.bfloat16 and small.headers.dtype == "bfloat16"


async def test_endpoints_health_info_metrics_and_delete() -> None:
    async with chain(2) as c, Client(c.gateway.url) as client:
        with anyio.fail_after(LIMIT):
            result = await client.forward(activation(20, 4))
            info = await client.info()
            health = await client.pool.request("GET", "/health?deep=1", _deadline())
            metrics = await client.pool.request("GET", "/metrics", _deadline())
            assert await client.delete_session(result.session) is True
            assert await delete_session(c.gateway.url, result.session) is False
            missing = await client.pool.request("GET", "/nope", _deadline())
    assert info["role"] == "gateway" and info["wire"] == 2 and info["entry"] == c.entry
    assert info["chunk_tokens"] == 128 and info["sessions"]["held"] == 1
    assert health.status == 200 and b'"downstream"' in health.body
    assert metrics.status == 200 and b'meshnet_requests_total{endpoint="/forward"' in metrics.body
    assert missing.status == 404
    assert not any(result.session in n.app.table for n in c.nodes)


async def test_token_is_required_and_presented_downstream() -> None:
    token = ["--token", "s3cret-token"]
    async with chain(2, node_flags=token, gateway_flags=token) as c:
        with anyio.fail_after(LIMIT):
            with pytest.raises(RemoteError) as caught:
                await forward_via_gateway(c.gateway.url, activation(10, 4))
            assert caught.value.status == 401
            ok = await forward_via_gateway(c.gateway.url, activation(10, 4), token="s3cret-token")
        assert same_bits(ok.output, activation(10, 4))
        assert c.gateway.app.entry_window == 16  # /info was read with the token


def test_reorder_window_is_read_from_top_level_or_limits() -> None:
    assert reorder_window({"reorder_window": 4}) == 4
    assert reorder_window({"limits": {"reorder_window": 3}}) == 3
    assert reorder_window({"limits": {"reorder_window": True}}) is None
    with pytest.raises(ValueError):
        reorder_window([])


def _deadline():  # type: ignore[no-untyped-def]
    from meshnet_runtime.deadlines import Deadline

    return Deadline.after(LIMIT)


async def test_a_hang_deep_in_the_chain_is_named_by_the_node_nearest_to_it() -> None:
    """wire-2 §4 deadlines: gateway → node 1 → node 2 → a stage that accepts and
    never answers (a stopped process). Each sender passes the time left minus
    a margin, so node 2 — nearest the hang — gives up first and answers 504
    naming the hung hop; node 1 and the gateway relay that, rather than each
    timing out on its own and blaming its neighbour."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    hung = f"http://127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"

    async def hold(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, hold)
        async with contextlib.AsyncExitStack() as stack:
            # The gateway deletes the session down the chain after the failure;
            # that DELETE hangs at node 2 too: short node timeouts keep the
            # test's shutdown quick.
            quick = [*QUIET, "--timeout", "3", "--shutdown-timeout", "1"]
            node2 = await stack.enter_async_context(
                serve_node(NodeConfig.load([*quick, "--next", hung]))
            )
            node1 = await stack.enter_async_context(
                serve_node(NodeConfig.load([*quick, "--next", node2.url]))
            )
            gateway = await stack.enter_async_context(
                open_gateway(GatewayConfig.load([*QUIET, "--entry", node1.url, "--timeout", "1.5"]))
            )
            with anyio.fail_after(LIMIT), pytest.raises(RemoteError) as caught:
                await forward_via_gateway(gateway.url, activation(10, 4))
            err = caught.value
            assert (err.status, err.code, err.hop) == (504, "downstream_timeout", hung)
        tg.cancel_scope.cancel()
    await listener.aclose()
