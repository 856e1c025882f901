"""meshnet-node in process: chains over real loopback sockets, UDS and TLS.

The story (US-011): a 512-token bfloat16 activation crosses a two-node chain
as 4 chunks of 128, zstd-encoded, and every chunk's response carries the
right headers. Around it: ordering, replay, bad input, access control,
downstream failures and session ending.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import anyio
import ml_dtypes
import numpy as np
import pytest
import trustme
from anyio.abc import SocketAttribute
from prometheus_client.parser import text_string_to_metric_families

from meshnet_node import RunningNode, Stage, serve_node
from meshnet_node.backends import echo
from meshnet_node.config import NodeConfig
from meshnet_proto import ActivationResponse, ErrorResponse, Response, WireHeaders, encode_for_wire
from meshnet_proto._chunking import plan_chunks
from meshnet_proto._codec import decode_tensor
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool
from support.gateway import closed_port_url
from support.waiting import Waits, wait_until
from support.wire import exchange, forward_request, http_request, read_answer

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def chain(
    *per_node: list[str], stages: list[Stage] | None = None
) -> AsyncIterator[list[RunningNode]]:
    """Nodes started last-first, each pointing at the next; yields entry first."""
    async with AsyncExitStack() as stack:
        nodes: list[RunningNode] = []
        for i, args in reversed(list(enumerate(per_node))):
            argv = ["--port", "0", *args]
            if nodes:
                argv += ["--next", nodes[0].url]
            stage = stages[i] if stages else None
            node = await stack.enter_async_context(
                serve_node(NodeConfig.load(argv, {}), stage=stage)
            )
            nodes.insert(0, node)
        yield nodes


async def send(
    pool: DownstreamPool,
    array: np.ndarray,
    session: str,
    index: int = 0,
    total: int = 1,
    position: int | None = 0,
    encoding: str = "identity",
    timeout: float = 20.0,
) -> ActivationResponse | ErrorResponse:
    dtype, enc, body = encode_for_wire(array, encoding_policy=encoding)
    headers = WireHeaders(shape=array.shape, dtype=dtype, session=session, chunk_index=index,
                          chunk_total=total, encoding=enc, position=position)  # fmt: skip
    return await pool.forward(headers, body, Deadline.after(timeout))


def activation(shape: tuple[int, ...] = (1, 8, 4), seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype("<f4")


def wire(session: str, **overrides: str) -> dict[str, str]:
    base = {"X-Meshnet-Shape": "1,2,2", "X-Meshnet-Dtype": "float32",
            "X-Meshnet-Session": session, "X-Meshnet-Chunk-Index": "0",
            "X-Meshnet-Chunk-Total": "1"}  # fmt: skip
    base.update(overrides)
    return {k: v for k, v in base.items() if v != "-"}


# ------------------------------------------------------------------ the story


async def test_story_512_tokens_bf16_zstd_through_two_nodes() -> None:
    async with chain([], []) as (entry, last):
        pool = DownstreamPool(entry.url)
        x = np.random.default_rng(11).standard_normal((1, 512, 4096)).astype(ml_dtypes.bfloat16)
        session = str(uuid.uuid4())
        chunks = plan_chunks(x, 128)
        assert len(chunks) == 4
        for chunk in chunks:
            response = await send(pool, chunk.view, session, chunk.index, chunk.total,
                                  chunk.position, encoding="zstd")  # fmt: skip
            assert isinstance(response, ActivationResponse), response
            h = response.headers
            assert h.shape == (1, 128, 4096)
            assert h.dtype == "bfloat16"
            assert h.session == session
            assert (h.chunk_index, h.chunk_total) == (chunk.index, 4)
            assert h.encoding == "zstd"
            assert h.position == chunk.position == 128 * chunk.index
            out = decode_tensor(h, response.body)
            assert out.tobytes() == np.ascontiguousarray(chunk.view).tobytes()
        assert last.app.table.position(session) == 512
        await pool.aclose()


async def test_zeros_backend_and_wire_dtype_policy() -> None:
    async with chain(["--backend", "zeros", "--wire-dtype", "bfloat16"]) as (node,):
        pool = DownstreamPool(node.url)
        response = await send(pool, activation(), str(uuid.uuid4()))
        assert isinstance(response, ActivationResponse)
        assert response.headers.dtype == "bfloat16"
        assert not decode_tensor(response.headers, response.body).any()
        await pool.aclose()


# ------------------------------------------------------------------ ordering


async def test_out_of_order_chunks_wait_for_their_turn() -> None:
    async with chain([], []) as (entry, _):
        pool = DownstreamPool(entry.url)
        session = str(uuid.uuid4())
        x = activation((1, 16, 4))
        chunks = plan_chunks(x, 4)
        results: dict[int, ActivationResponse | ErrorResponse] = {}

        async def one(index: int) -> None:
            c = chunks[index]
            results[index] = await send(pool, c.view, session, c.index, c.total, c.position)

        waits = Waits(entry.app.seq)
        async with anyio.create_task_group() as tg:
            for index in (3, 2, 1):
                tg.start_soon(one, index)
            await wait_until(lambda: waits.count == 3, "chunks 3, 2, 1 waiting")
            tg.start_soon(one, 0)
        for chunk in chunks:
            response = results[chunk.index]
            assert isinstance(response, ActivationResponse), response
            assert response.headers.position == chunk.position
            assert decode_tensor(response.headers, response.body).tobytes() == (
                np.ascontiguousarray(chunk.view).tobytes()
            )
        await pool.aclose()


async def test_wait_beyond_reorder_timeout_is_409() -> None:
    async with chain(["--reorder-timeout", "0.3"]) as (node,):
        pool = DownstreamPool(node.url)
        # Positions far ahead: never impossible, never reached (wire-2 §3.9
        # wants one on every chunk but a new session's first).
        response = await send(pool, activation(), str(uuid.uuid4()), index=2, total=4,
                              position=10**6)  # fmt: skip
        assert isinstance(response, ErrorResponse)
        assert (response.status, response.error["code"]) == (409, "session_unknown")
        session = str(uuid.uuid4())
        assert isinstance(await send(pool, activation(), session, 0, 4, 0), ActivationResponse)
        response = await send(pool, activation(), session, 2, 4, 10**6)
        assert isinstance(response, ErrorResponse)
        assert (response.status, response.error["code"]) == (409, "chunk_wait_timeout")
        await pool.aclose()
        # A timed-out wait leaves nothing behind: a stream of chunks for
        # sessions that never start must not grow the node's memory.
        assert node.app.sessions_with_waiters == 0


async def test_retransmission_replays_without_rerunning_the_stage() -> None:
    stages = [Stage("echo", echo), Stage("echo", echo)]
    async with chain([], [], stages=stages) as (entry, _):
        pool = DownstreamPool(entry.url)
        session, x = str(uuid.uuid4()), activation()
        first = await send(pool, x, session, 0, 2, 0)
        again = await send(pool, x, session, 0, 2, 0, encoding="zstd")  # encoding may differ
        assert isinstance(first, ActivationResponse) and isinstance(again, ActivationResponse)
        assert bytes(first.body) == bytes(again.body)
        assert [s.calls for s in stages] == [1, 1]
        conflict = await send(pool, activation(seed=1), session, 0, 2, 0)
        assert isinstance(conflict, ErrorResponse)
        assert (conflict.status, conflict.error["code"]) == (409, "chunk_conflict")
        assert [s.calls for s in stages] == [1, 1]
        await pool.aclose()


# ------------------------------------------------------------------ bad input


async def test_bad_input_is_4xx_json_and_the_node_keeps_serving() -> None:
    s = str(uuid.uuid4())
    body = bytes(16)
    cases = [
        (wire(s, **{"X-Meshnet-Session": "-"}), body, 400, "missing_header"),
        (wire(s, **{"X-Meshnet-Dtype": "Float32"}), body, 400, "bad_dtype"),
        (wire(s, **{"X-Meshnet-Dtype": "float64"}), body, 415, "unsupported_dtype"),
        (wire(s, **{"X-Meshnet-Encoding": "gzip"}), body, 415, "unsupported_encoding"),
        (wire(s, **{"X-Meshnet-Chunk-Index": "00"}), body, 400, "bad_integer"),
        (wire(s, **{"X-Meshnet-Wire": "1"}), body, 400, "wire_version_mismatch"),
        (wire(s, **{"X-Meshnet-Shape": "1,0"}), body, 400, "bad_shape"),
        (wire(s, **{"X-Meshnet-Shape": "65536,65536,65536"}), body, 413, "tensor_too_large"),
        (wire(s, **{"X-Meshnet-Session": "NOT-A-UUID"}), body, 400, "bad_session"),
        (wire(s, **{"X-Meshnet-Position": "5"}), body, 409, "session_unknown"),
        (wire(s, **{"X-Meshnet-Deadline-Ms": "0"}), body, 504, "deadline_exceeded"),
        (wire(s, **{"X-Meshnet-Encoding": "zstd"}), b"not a frame", 400, "bad_zstd_frame"),
        (wire(s), bytes(15), 400, "body_size_mismatch"),
        (wire(s, **{"Content-Type": "application/json"}), b"{}", 415, "wire1_gone"),
    ]
    async with chain([]) as (node,):
        for headers, payload, status, code in cases:
            got, response_headers, document = await exchange(
                node.url, forward_request(headers, payload)
            )
            assert (got, json.loads(document)["error"]["code"]) == (status, code), headers
            assert response_headers["content-type"] == "application/json"
        pool = DownstreamPool(node.url)  # other sessions are still served
        assert isinstance(await send(pool, activation(), str(uuid.uuid4())), ActivationResponse)
        await pool.aclose()


async def test_token_guards_everything_but_health_and_is_presented_downstream() -> None:
    token = "s3cret-token"
    async with chain(["--token", token], ["--token", token]) as (entry, _):
        s = str(uuid.uuid4())
        status, _headers, document = await exchange(entry.url, forward_request(wire(s), bytes(16)))
        assert (status, json.loads(document)["error"]["code"]) == (401, "unauthorized")
        assert token not in document.decode()
        status, _, _ = await exchange(entry.url, forward_request(wire(s), bytes(16), token="wrong"))
        assert status == 401
        assert (await exchange(entry.url, http_request("GET", "/health"))).status == 200
        assert (await exchange(entry.url, http_request("GET", "/info"))).status == 401
        request = forward_request(wire(s), bytes(16), token=token)
        status, _, body = await exchange(entry.url, request)
        assert status == 200 and body == bytes(16)  # the entry presented its token downstream


# ------------------------------------------------------------------ downstream failures


async def test_downstream_down_is_502_naming_the_hop() -> None:
    dead = closed_port_url()
    async with serve_node(NodeConfig.load(["--port", "0", "--next", dead], {})) as node:
        pool = DownstreamPool(node.url)
        session = str(uuid.uuid4())
        with anyio.fail_after(60):  # ends a hang; not a timing claim
            response = await send(pool, activation(), session)
        assert isinstance(response, ErrorResponse)
        assert response.status == 502
        assert (response.error["code"], response.error["hop"]) == ("downstream_unreachable", dead)
        # The stage output was kept: a retransmission reforwards (still failing here).
        again = await send(pool, activation(), session)
        assert isinstance(again, ErrorResponse) and again.status == 502
        assert node.app.stage.calls == 1
        await pool.aclose()


async def test_hung_downstream_and_a_deadline_is_504_naming_it() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    hung = f"http://127.0.0.1:{listener.extra(SocketAttribute.local_port)}"

    async def swallow(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, swallow)
        async with serve_node(NodeConfig.load(["--port", "0", "--next", hung], {})) as node:
            s = str(uuid.uuid4())
            request = forward_request(wire(s, **{"X-Meshnet-Deadline-Ms": "500"}), bytes(16))
            status, _, document = await exchange(node.url, request)
            error = json.loads(document)["error"]
            assert (status, error["code"], error["hop"]) == (504, "downstream_timeout", hung)
        tg.cancel_scope.cancel()


async def test_downstream_error_is_relayed_with_the_deepest_hop() -> None:
    async with chain([], [], ["--reorder-timeout", "0.2"]) as (entry, _middle, last):
        # Make the last node refuse: it already ran chunk 0 of this session
        # with a different tensor, so the chain's retransmission conflicts.
        s = str(uuid.uuid4())
        direct = DownstreamPool(last.url)
        assert isinstance(await send(direct, activation(seed=5), s, 0, 2, 0), ActivationResponse)
        pool = DownstreamPool(entry.url)
        response = await send(pool, activation(seed=6), s, 0, 2, 0)
        assert isinstance(response, ErrorResponse)
        assert (response.status, response.error["code"]) == (409, "chunk_conflict")
        assert response.error["hop"] == last.url  # named by the middle node, relayed as is
        await pool.aclose()
        await direct.aclose()


# ------------------------------------------------------------------ endpoints


async def test_info_health_metrics_and_delete_down_the_chain() -> None:
    async with chain([], []) as (entry, last):
        pool = DownstreamPool(entry.url)
        s = str(uuid.uuid4())
        assert isinstance(await send(pool, activation(), s), ActivationResponse)
        assert s in last.app.table

        info = await pool.request("GET", "/info", Deadline.after(10))
        assert isinstance(info, Response)
        document = json.loads(info.body)
        assert (document["role"], document["wire"], document["downstream"]) == ("node", 2, last.url)
        assert document["reorder_window"] == 16
        assert document["stage"]["backend"] == "echo"
        # wire-2 §6: every limit, named as in Limits (and the server's own).
        limits = document["limits"]
        assert limits["max_tensor_bytes"] == 512 * 1024 * 1024
        assert limits["max_stored_bytes"] == 1024 * 1024 * 1024
        assert limits["max_inflight_bytes"] == 2048 * 1024 * 1024
        assert (limits["reorder_timeout"], limits["max_connections"]) == (10.0, 256)

        health = await pool.request("GET", "/health?deep=1", Deadline.after(10))
        assert isinstance(health, Response)
        assert json.loads(health.body)["downstream"]["status"] == "ok"

        metrics = await pool.request("GET", "/metrics", Deadline.after(10))
        assert isinstance(metrics, Response)
        families = {f.name: f for f in text_string_to_metric_families(metrics.body.decode())}
        processed = [
            sample
            for sample in families["meshnet_chunks"].samples
            if sample.labels.get("outcome") == "processed" and sample.name.endswith("_total")
        ]
        assert processed[0].value == 1
        assert "meshnet_sessions" in families and "meshnet_stage_seconds" in families

        deleted = await pool.request("DELETE", f"/sessions/{s}", Deadline.after(10))
        assert deleted.status == 204
        assert s not in entry.app.table and s not in last.app.table
        gone = await pool.request("DELETE", f"/sessions/{s}", Deadline.after(10))
        assert isinstance(gone, ErrorResponse) and gone.status == 404
        await pool.aclose()


async def test_deep_health_names_a_dead_downstream() -> None:
    async with chain([], []) as (entry, last):
        last.server.request_shutdown()
        pool = DownstreamPool(entry.url)
        answers: list[object] = []

        async def unhealthy() -> bool:
            answers.append(await pool.request("GET", "/health?deep=1", Deadline.after(10)))
            return isinstance(answers[-1], ErrorResponse)

        await wait_until(unhealthy, "the last node's listener gone", every=0.05)
        health = answers[-1]
        assert isinstance(health, ErrorResponse)
        assert (health.status, health.error["hop"]) == (502, last.url)
        await pool.aclose()


# ------------------------------------------------------------------ transports


async def test_chain_over_unix_socket_and_tls(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    paths = {name: str(tmp_path / f"{name}.pem") for name in ("cert", "key", "ca")}
    cert.cert_chain_pems[0].write_to_path(paths["cert"])
    cert.private_key_pem.write_to_path(paths["key"])
    ca.cert_pem.write_to_path(paths["ca"])
    sock = str(tmp_path / "last.sock")

    async with AsyncExitStack() as stack:
        last = await stack.enter_async_context(serve_node(NodeConfig.load(["--uds", sock], {})))
        middle = await stack.enter_async_context(serve_node(NodeConfig.load(
            ["--port", "0", "--next", last.url, "--tls-cert", paths["cert"],
             "--tls-key", paths["key"]], {},
        )))  # fmt: skip
        entry = await stack.enter_async_context(serve_node(NodeConfig.load(
            ["--port", "0", "--next", middle.url, "--tls-ca", paths["ca"]], {},
        )))  # fmt: skip
        assert last.url == f"unix:{sock}" and middle.url.startswith("https://")
        pool = DownstreamPool(entry.url)
        x = activation()
        response = await send(pool, x, str(uuid.uuid4()))
        assert isinstance(response, ActivationResponse)
        assert decode_tensor(response.headers, response.body).tobytes() == x.tobytes()
        await pool.aclose()


async def test_node_over_memory_streams_is_the_same_driver() -> None:
    from meshnet_node import build_node
    from meshnet_runtime.transports import memory_stream_pair

    _, server = build_node(NodeConfig.load([], {}))
    client, served = memory_stream_pair()
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve_stream, served)
        await client.send(forward_request(wire(str(uuid.uuid4())), bytes(16)))
        status, headers, body = await read_answer(client)
        assert (status, headers["x-meshnet-position"], body) == (200, "0", bytes(16))
        await client.aclose()


async def test_a_rebuilds_delete_ends_the_session_at_that_node_only() -> None:
    """``DELETE /sessions/{id}?replay=1`` (a replica set about to rebuild a
    stale copy by replay, wire-2 §3.8) forgets the session at the node it is
    sent to and nowhere below: the stages below keep the state the replay
    will not forward to them. A plain DELETE passes down the chain."""
    key = {"X-Meshnet-Session-Key": "ab" * 16}
    async with chain([], []) as (entry, last):
        pool = DownstreamPool(entry.url)
        session = str(uuid.uuid4())
        dtype, enc, body = encode_for_wire(activation(), encoding_policy="identity")
        headers = WireHeaders(shape=(1, 8, 4), dtype=dtype, session=session, chunk_index=0,
                              chunk_total=1, encoding=enc, position=0,
                              session_key=key["X-Meshnet-Session-Key"])  # fmt: skip
        assert not isinstance(await pool.forward(headers, body, Deadline.after(20)), ErrorResponse)
        pairs = [(name.encode(), value.encode()) for name, value in key.items()]
        local = await pool.request("DELETE", f"/sessions/{session}?replay=1", Deadline.after(10),
                                   pairs)  # fmt: skip
        assert local.status == 204
        assert session not in entry.app.table and session in last.app.table
        await pool.request("DELETE", f"/sessions/{session}", Deadline.after(10), pairs)
        assert session not in last.app.table
        await pool.aclose()
