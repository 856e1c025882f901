"""Hostile peers over real loopback sockets: a node must answer every bad
input with a wire-2 §4 4xx, stay up, keep other sessions intact and never
hold memory that grows with what peers send.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import numpy as np
import pytest

from meshnet_node import RunningNode, serve_node
from meshnet_node.config import NodeConfig
from meshnet_proto import (
    ErrorResponse,
    Limits,
    SequencingError,
    SessionTable,
    WireHeaders,
    encode_for_wire,
)
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool
from support.serving import scripted_peer
from support.waiting import wait_until

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def node(*args: str) -> AsyncIterator[RunningNode]:
    async with serve_node(NodeConfig.load(["--port", "0", *args], {})) as running:
        yield running


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def exchange(url: str, data: bytes, *, limit: int = 1 << 20) -> bytes:
    """Send raw bytes, half-close, read the whole answer (bounded in size and time)."""
    host, port = host_port(url)
    out = bytearray()
    with anyio.fail_after(60):
        async with await anyio.connect_tcp(host, port) as stream:
            await stream.send(data)
            await stream.send_eof()
            while len(out) < limit:
                try:
                    out += await stream.receive(65536)
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    break
    return bytes(out)


def status_and_code(answer: bytes) -> tuple[int, str | None]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if status < 400:
        return status, None
    return status, json.loads(body)["error"]["code"]


def forward_request(
    *,
    shape: str = "1,4,4",
    dtype: str = "float32",
    session: str | None = None,
    index: int = 0,
    total: int = 1,
    extra: bytes = b"",
    length: bytes | None = None,
    body: bytes | None = None,
) -> bytes:
    session = session or str(uuid.uuid4())
    body = bytes(64) if body is None else body
    length = str(len(body)).encode() if length is None else length
    head = (
        b"POST /forward HTTP/1.1\r\nHost: node\r\nConnection: close\r\n"
        b"Content-Type: application/octet-stream\r\n"
        + f"X-Meshnet-Shape: {shape}\r\nX-Meshnet-Dtype: {dtype}\r\n"
        f"X-Meshnet-Session: {session}\r\nX-Meshnet-Chunk-Index: {index}\r\n"
        f"X-Meshnet-Chunk-Total: {total}\r\n".encode()
        + extra
        + b"Content-Length: "
        + length
        + b"\r\n\r\n"
    )
    return head + body


HOSTILE = [
    ("content-length 10^18", dict(length=b"1000000000000000000"), 413, "body_too_large"),
    ("content-length 2^63", dict(length=b"9223372036854775808"), 413, "body_too_large"),
    ("content-length negative", dict(length=b"-1"), 400, "bad_framing"),
    ("content-length plus sign", dict(length=b"+64"), 400, "bad_framing"),
    ("content-length 23 digits", dict(length=b"9" * 23), 400, "bad_framing"),
    ("shape product over int64", dict(shape="4294967296,4294967296"), 413, "tensor_too_large"),
    ("8 dims of 65536", dict(shape=",".join(["65536"] * 8)), 413, "tensor_too_large"),
    ("dimension 2^64", dict(shape="18446744073709551616,1"), 400, "bad_shape"),
    ("NUL in a header", dict(extra=b"X-Foo: a\x00b\r\n"), 400, "malformed_request"),
    ("bare CR in a header", dict(extra=b"X-Foo: a\rb\r\n"), 400, "malformed_request"),
    ("non-ascii in a wire value", dict(dtype="fl\u00f6at32"), 400, "bad_dtype"),
    (
        "many unknown X-Meshnet headers over 16 KiB",
        dict(extra=b"".join(b"X-Meshnet-Z%d: 1\r\n" % i for i in range(1200))),
        431,
        "header_block_too_large",
    ),
]


@pytest.mark.parametrize(("name", "parts", "status", "code"), HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_hostile_request_gets_4xx_and_node_stays_up(
    name: str, parts: dict, status: int, code: str
) -> None:
    async with node() as running:
        got = status_and_code(await exchange(running.url, forward_request(**parts)))
        assert got == (status, code), name
        assert status_and_code(await exchange(running.url, forward_request())) == (200, None)


async def test_headers_just_under_the_limit_are_served() -> None:
    request = forward_request()
    extra = b"".join(b"X-B%04d: b\r\n" % i for i in range((15_900 - len(request)) // 12))
    async with node() as running:
        answer = await exchange(running.url, forward_request(extra=extra))
        assert status_and_code(answer) == (200, None)


@pytest.mark.parametrize(
    ("target", "method", "status"),
    [
        (b"/../../etc/passwd", b"GET", 404),
        (b"/sessions/../../etc/passwd", b"DELETE", 404),
        (b"/sessions/not-a-uuid", b"DELETE", 404),
        (b"http://evil.example/forward", b"POST", 404),
        (b"*", b"OPTIONS", 404),
        (b"127.0.0.1:22", b"CONNECT", 404),
    ],
)
async def test_odd_request_targets(target: bytes, method: bytes, status: int) -> None:
    async with node() as running:
        request = method + b" " + target + b" HTTP/1.1\r\nHost: node\r\n\r\n"
        got_status, code = status_and_code(await exchange(running.url, request))
        assert got_status == status and code is not None
        assert status_and_code(await exchange(running.url, forward_request())) == (200, None)


async def test_chunked_body_with_endless_extensions_is_refused() -> None:
    async with node() as running:
        head = forward_request(body=b"").split(b"Content-Length")[0]
        request = head + b"Transfer-Encoding: chunked\r\n\r\n40;" + b"a=b;" * 50_000 + b"\r\n"
        assert status_and_code(await exchange(running.url, request)) == (
            431,
            "header_block_too_large",
        )


async def send_chunk(pool: DownstreamPool, array: np.ndarray, session: str):
    dtype, enc, body = encode_for_wire(array)
    headers = WireHeaders(shape=array.shape, dtype=dtype, session=session, chunk_index=0,
                          chunk_total=1, encoding=enc, position=0)  # fmt: skip
    return await pool.forward(headers, body, Deadline.after(10))


async def test_stored_responses_are_held_to_a_byte_budget() -> None:
    """Many sessions each leaving a stored answer must not make the node hold
    max_sessions x window x max_tensor_bytes: past the budget the oldest stored
    answers go, and their retransmission is refused (409), never run again."""
    array = np.ones((1, 64, 16), dtype=np.float32)  # 4 KiB
    async with node("--max-stored-bytes", str(3 * array.nbytes)) as running:
        pool = DownstreamPool(running.url)
        try:
            first = str(uuid.uuid4())
            assert not isinstance(await send_chunk(pool, array, first), ErrorResponse)
            # While within budget the retransmission is a replay.
            assert not isinstance(await send_chunk(pool, array, first), ErrorResponse)
            for _ in range(20):
                answer = await send_chunk(pool, array, str(uuid.uuid4()))
                assert not isinstance(answer, ErrorResponse)
                assert running.app.table.stored_bytes <= 3 * array.nbytes
            again = await send_chunk(pool, array, first)
            assert isinstance(again, ErrorResponse)
            assert (again.status, again.error["code"]) == (409, "chunk_conflict")
        finally:
            await pool.aclose()


def test_session_table_counts_and_evicts_stored_bytes() -> None:
    from meshnet_proto import Process, Replay, tensor_fingerprint

    table = SessionTable(Limits(max_stored_bytes=100))
    array = np.zeros((1, 2, 2), dtype=np.float32)
    headers = {
        sid: WireHeaders.for_array(array, session=sid, chunk_index=0, chunk_total=1, position=0)
        for sid in (str(uuid.uuid4()) for _ in range(3))
    }
    fp = tensor_fingerprint(array)
    for h in headers.values():
        decision = table.offer(h, fp, 0.0)
        assert isinstance(decision, Process)
        table.stage_done(decision.ticket, array, 0.0)
        table.response_ready(decision.ticket, f"answer {h.session}", 0.0, nbytes=40)
        assert table.stored_bytes <= 100
    oldest, *kept = headers.values()
    for h in kept:
        assert isinstance(table.offer(h, fp, 1.0), Replay)
    with pytest.raises(SequencingError) as caught:
        table.offer(oldest, fp, 1.0)
    assert caught.value.code == "chunk_conflict"
    assert table.stored_bytes == 80


@asynccontextmanager
async def scripted_downstream(answer: bytes) -> AsyncIterator[str]:
    """A loopback 'node' that answers every request head with ``answer``."""

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            with anyio.move_on_after(5):
                seen = b""
                while b"\r\n\r\n" not in seen:
                    seen += await stream.receive(65536)
                await stream.send(answer)

    async with scripted_peer(handle) as url:
        yield url


@pytest.mark.parametrize("status", [b"600", b"999"])
async def test_downstream_status_beyond_599_is_502_not_500(status: bytes) -> None:
    answer = b"HTTP/1.1 " + status + b" Weird\r\nContent-Length: 0\r\n\r\n"
    async with scripted_downstream(answer) as fake, node("--next", fake) as running:
        got = status_and_code(await exchange(running.url, forward_request()))
        assert got == (502, "downstream_bad_response")
        health = b"GET /health?deep=1 HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n"
        assert status_and_code(await exchange(running.url, health))[0] != 500


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_promised_body_costs_memory_only_as_it_arrives() -> None:
    """A ~300-byte head promising a 256 MiB tensor, then 1 KiB of body, must
    not make the node commit 256 MiB: with max_connections such heads would
    take max_connections x max_tensor_bytes for the whole body timeout."""
    from meshnet_proto import NEED_DATA, ActivationHead, ServerConnection

    conn = ServerConnection()
    request = forward_request(shape="1,65536,1024", length=str(256 * 1024 * 1024).encode())
    conn.receive_data(request + bytes(1024))
    assert isinstance(conn.next_event(), ActivationHead)
    before = rss_bytes()
    assert conn.next_event() is NEED_DATA  # the body reader is set up, 1 KiB in
    grown = rss_bytes() - before
    assert grown < 32 * 1024 * 1024, f"RSS grew {grown >> 20} MiB for 1 KiB of body"


def test_stored_bytes_forget_answers_of_ended_sessions() -> None:
    # An ended session's stored answers no longer count against the budget,
    # and eviction skips entries whose answer is already gone.
    from meshnet_proto import Process, tensor_fingerprint

    table = SessionTable(Limits(max_stored_bytes=100))
    array = np.zeros((1, 2, 2), dtype=np.float32)
    fp = tensor_fingerprint(array)
    sessions = [str(uuid.uuid4()) for _ in range(3)]
    for sid in sessions[:2]:
        h = WireHeaders.for_array(array, session=sid, chunk_index=0, chunk_total=1, position=0)
        decision = table.offer(h, fp, 0.0)
        assert isinstance(decision, Process)
        table.stage_done(decision.ticket, array, 0.0)
        table.response_ready(decision.ticket, "answer", 0.0, nbytes=40)
    assert table.stored_bytes == 80
    assert table.end_session(sessions[0])
    assert table.stored_bytes == 40
    # Over budget again: the ended session's entry (if still listed) is not
    # what gets evicted; the live one is, oldest first.
    assert table.end_session(sessions[1])
    h = WireHeaders.for_array(array, session=sessions[2], chunk_index=0, chunk_total=1, position=0)
    decision = table.offer(h, fp, 1.0)
    assert isinstance(decision, Process)
    table.stage_done(decision.ticket, array, 1.0)
    table.response_ready(decision.ticket, "answer", 1.0, nbytes=120)
    assert table.stored_bytes == 0


async def test_many_legal_requests_cannot_add_up_past_the_inflight_budget() -> None:
    # Each request is legal on its own (256 KiB); together they would hold
    # more than --max-inflight-bytes. A second one while the first holds its
    # reservation (body still streaming) is 503 memory_full with Retry-After,
    # before any of its body is read; once the first is done, room is back.
    tensor = 256 * 1024
    async with node("--max-inflight-bytes", str(tensor + tensor // 2)) as running:
        host, port = host_port(running.url)
        shape = f"1,{tensor // 4 // 64},64"
        request = forward_request(shape=shape, body=bytes(tensor))
        head, body = request[: len(request) - tensor], request[len(request) - tensor :]
        with anyio.fail_after(60):  # ends a hang; not a timing claim
            async with await anyio.connect_tcp(host, port) as slow:
                await slow.send(head + body[:1024])  # holds its reservation
                budget = running.server.budget
                assert budget is not None
                await wait_until(lambda: budget.in_use, "the server's reservation")
                assert budget.in_use == tensor
                answer = await exchange(running.url, forward_request(shape=shape, body=b""))
                status, code = status_and_code(answer)
                assert (status, code) == (503, "memory_full")
                assert b"retry-after: 1" in answer.lower()
                await slow.send(body[1024:])
                reply = bytearray()
                while b"\r\n\r\n" not in reply:
                    reply += await slow.receive(65536)
                assert reply.startswith(b"HTTP/1.1 200")
        # (a new session: the one above exists now, and its chunk 0 carries no
        # position, which only a new session's first chunk may omit, wire-2 §3.9)
        answer = await exchange(running.url, forward_request(shape=shape, body=bytes(tensor)))
        assert status_and_code(answer) == (200, None)
        assert budget.in_use == 0
        metrics = running.app.metrics.render().decode()
        assert "meshnet_inflight_tensor_bytes 0.0" in metrics


def test_outputs_kept_for_a_reforward_count_against_the_stored_budget() -> None:
    # A downstream that keeps failing must not let a peer park stage outputs
    # (kept for a reforward) beyond max_stored_bytes: the oldest go, and a
    # retransmission of theirs is 409 — its stage already ran, so it cannot
    # simply run again.
    from meshnet_proto import Process, Reforward, tensor_fingerprint

    table = SessionTable(Limits(max_stored_bytes=100))
    array = np.zeros((1, 2, 2), dtype=np.float32)
    fp = tensor_fingerprint(array)
    sessions = [str(uuid.uuid4()) for _ in range(3)]
    chunk = {
        sid: WireHeaders.for_array(array, session=sid, chunk_index=0, chunk_total=1, position=0)
        for sid in sessions
    }
    for sid in sessions:
        decision = table.offer(chunk[sid], fp, 0.0)
        assert isinstance(decision, Process)
        table.stage_done(decision.ticket, array, 0.0)
        table.forward_failed(decision.ticket, 0.0, nbytes=40)
        assert table.stored_bytes <= 100
    oldest, *kept = sessions
    with pytest.raises(SequencingError) as caught:
        table.offer(chunk[oldest], fp, 1.0)
    assert (caught.value.status, caught.value.code) == (409, "chunk_conflict")
    for sid in kept:
        again = table.offer(chunk[sid], fp, 1.0)
        assert isinstance(again, Reforward) and again.stage_output is array
    # Reforwarded outputs are in flight again, not held: they leave the budget.
    assert table.stored_bytes == 0


async def test_a_failing_downstream_holds_reforward_outputs_to_the_budget() -> None:
    # The entry node's downstream is gone: every chunk's forward fails (502)
    # and the node keeps its stage output for a reforward. With a small
    # --max-stored-bytes those outputs are held to it, not to the count bounds.
    tensor = 64 * 1024
    async with node(
        "--next", "http://127.0.0.1:9", "--max-stored-bytes", str(2 * tensor)
    ) as running:
        pool = DownstreamPool(running.url)
        try:
            x = np.ones((1, tensor // 4 // 64, 64), dtype=np.float32)
            for _ in range(6):
                dtype, enc, body = encode_for_wire(x)
                headers = WireHeaders(
                    shape=x.shape,
                    dtype=dtype,
                    session=str(uuid.uuid4()),
                    chunk_index=0,
                    chunk_total=1,
                    encoding=enc,
                    position=0,
                )
                answer = await pool.forward(headers, body, Deadline.after(10))
                assert isinstance(answer, ErrorResponse)
                assert (answer.status, answer.error["code"]) == (502, "downstream_unreachable")
                assert answer.error["hop"] == "http://127.0.0.1:9"
                assert running.app.table.stored_bytes <= 2 * tensor
            assert running.app.table.stored_bytes == 2 * tensor
        finally:
            await pool.aclose()
