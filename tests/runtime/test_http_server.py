"""The serving loop (meshnet_runtime.http_server) over real sockets and memory.

A tiny application stands in for the node: it echoes activations, can be
held to keep a request in flight, and has a deliberate bug to show that one
broken request never takes the server down.
"""

from __future__ import annotations

import contextlib
import json
import socket
from pathlib import Path

import anyio
import numpy as np
import pytest
import trustme

from meshnet_proto import (
    ActivationResponse,
    DownstreamError,
    ServerConnection,
    WireHeaders,
)
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool
from meshnet_runtime.endpoints import parse_endpoint
from meshnet_runtime.http_server import (
    HttpServer,
)
from meshnet_runtime.transports import (
    client_ssl_context,
    connect,
    memory_stream_pair,
    server_ssl_context,
)
from support.serving import BUGGY_SHAPE, REJECTED, SID, EchoApp, activation, at_eof, running
from support.waiting import wait_until
from support.wire import read_answer


@pytest.mark.anyio
async def test_keep_alive_round_trips_over_tcp() -> None:
    async with running() as (_, url):
        stream = await connect(parse_endpoint(url))
        for _ in range(3):  # one connection, three requests
            await stream.send(activation())
            status, headers, body = await read_answer(stream)
            assert status == 200
            assert headers["x-meshnet-session"] == SID
            assert body == activation()[-16:]
        await stream.send(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        status, _, body = await read_answer(stream)
        assert (status, json.loads(body)["status"]) == (200, "ok")
        await stream.aclose()


@pytest.mark.anyio
async def test_unix_socket_and_memory_streams(tmp_path: Path) -> None:
    path = str(tmp_path / "node.sock")
    async with running(uds=path) as (_, url):
        assert url == f"unix:{path}"
        stream = await connect(parse_endpoint(url))
        await stream.send(activation())
        assert (await read_answer(stream))[0] == 200
        await stream.aclose()
    assert not Path(path).exists()

    server = HttpServer(EchoApp(), lambda: ServerConnection())
    client, served = memory_stream_pair()
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve_stream, served)
        await client.send(activation())
        assert (await read_answer(client))[0] == 200
        await client.aclose()


@pytest.mark.anyio
async def test_slow_head_gets_408_and_idle_connection_just_closes() -> None:
    async with running(head_timeout=0.3) as (_, url):
        slow = await connect(parse_endpoint(url))
        await slow.send(b"POST /forward HTTP/1.1\r\nHost: t\r\n")  # never finished
        status, headers, body = await read_answer(slow)
        assert status == 408
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert headers["connection"] == "close"
        assert await at_eof(slow)

        idle = await connect(parse_endpoint(url))
        assert await at_eof(idle)  # no bytes sent: no 408, just a close


@pytest.mark.anyio
async def test_connection_cap_answers_503_with_retry_after() -> None:
    async with running(max_connections=1) as (_, url):
        first = await connect(parse_endpoint(url))
        await first.send(activation())
        assert (await read_answer(first))[0] == 200  # holds the only slot
        second = await connect(parse_endpoint(url))
        await second.send(activation())
        status, headers, body = await read_answer(second)
        assert status == 503
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        assert int(headers["retry-after"]) >= 1
        await first.send(activation())
        assert (await read_answer(first))[0] == 200
        await first.aclose()
        await second.aclose()


@pytest.mark.anyio
async def test_a_bug_is_a_500_and_the_server_keeps_serving() -> None:
    async with running() as (server, url):
        for request in (activation(shape=BUGGY_SHAPE), b"GET /info HTTP/1.1\r\nHost: t\r\n\r\n"):
            stream = await connect(parse_endpoint(url))
            await stream.send(request)
            status, _, body = await read_answer(stream)
            assert (status, json.loads(body)["error"]["code"]) == (500, "internal_error")
            await stream.aclose()
        stream = await connect(parse_endpoint(url))
        await stream.send(activation())
        assert (await read_answer(stream))[0] == 200
        await stream.aclose()
        assert server.metrics is not None
        assert b'status="500"' in server.metrics.render()


@pytest.mark.anyio
async def test_early_reject_is_readable_while_the_body_still_streams() -> None:
    async with running() as (_, url):
        stream = await connect(parse_endpoint(url))
        shape = (1, 256 * 1024)  # 1 MiB promised; only part of it is ever sent
        await stream.send(activation(shape=shape, session=REJECTED, body=b"\0" * 65536))
        status, headers, body = await read_answer(stream)
        assert (status, json.loads(body)["error"]["code"]) == (409, "session_unknown")
        assert headers["connection"] == "close"
        assert await at_eof(stream)


@pytest.mark.anyio
async def test_bad_input_is_4xx_json_never_500() -> None:
    cases = [
        (b"BREW /pot HTTP/1.1\r\nHost: t\r\n\r\n", 404),
        (b"GET /forward HTTP/1.1\r\nHost: t\r\n\r\n", 405),
        (activation(length=3), 400),
        (activation(extra=b"Transfer-Encoding: chunked\r\n"), 400),
        (b"\x16\x03\x01garbage\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: t\r\nX: " + b"a" * 20000 + b"\r\n\r\n", 431),
    ]
    async with running() as (_, url):
        for request, expected in cases:
            stream = await connect(parse_endpoint(url))
            await stream.send(request)
            status, headers, body = await read_answer(stream)
            assert status == expected, (request[:40], body)
            assert headers["content-type"] == "application/json"
            assert json.loads(body)["error"]["status"] == expected
            await stream.aclose()


@pytest.mark.anyio
async def test_graceful_shutdown_finishes_in_flight_and_refuses_new() -> None:
    app = EchoApp()
    app.hold = True
    async with running(app) as (server, url):
        busy = await connect(parse_endpoint(url))
        idle = await connect(parse_endpoint(url))
        await busy.send(activation())
        await app.entered.wait()
        server.request_shutdown()
        assert await at_eof(idle)  # idle keep-alive connections close at once
        # While the request in flight drains, a new connection is answered
        # 503 shutting_down with Retry-After (not refused: a sender can tell
        # "back off" from "crashed").
        late = await connect(parse_endpoint(url))
        await late.send(activation())
        status, headers, body = await read_answer(late)
        assert status == 503 and json.loads(body)["error"]["code"] == "shutting_down"
        assert headers["retry-after"] == "1"
        await late.aclose()
        app.release.set()
        status, _, body = await read_answer(busy)  # the request in flight completes
        assert status == 200 and len(body) == 16
        assert await at_eof(busy)

        async def refused() -> bool:
            try:
                await (await connect(parse_endpoint(url))).aclose()
            except OSError:
                return True
            return False

        await wait_until(refused, "the listener closed once the drain is done", every=0.05)


@pytest.mark.anyio
async def test_tls_server_and_pool(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_pem, key_pem, ca_pem = tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "ca.pem"
    cert.cert_chain_pems[0].write_to_path(cert_pem)
    cert.private_key_pem.write_to_path(key_pem)
    ca.cert_pem.write_to_path(ca_pem)
    async with running(tls=server_ssl_context(str(cert_pem), str(key_pem))) as (_, url):
        assert url.startswith("https://127.0.0.1:")
        pool = DownstreamPool(url, ssl_context=client_ssl_context(str(ca_pem)))
        headers = WireHeaders(shape=(1, 4), dtype="float32", session=SID, chunk_index=0,
                              chunk_total=1, position=0)  # fmt: skip
        body = np.arange(4, dtype="<f4").tobytes()
        for _ in range(2):
            response = await pool.forward(headers, body, Deadline.after(10))
            assert isinstance(response, ActivationResponse)
            assert bytes(response.body) == body
        health = await pool.request("GET", "/health", Deadline.after(10))
        assert health.status == 200
        await pool.aclose()

        untrusting = DownstreamPool(url, ssl_context=client_ssl_context(None))
        with pytest.raises(DownstreamError) as exc:
            await untrusting.request("GET", "/health", Deadline.after(10))
        assert (exc.value.code, exc.value.hop) == ("downstream_unreachable", url)


class _RecordingStream:
    """Just enough of a ByteStream to see how an answer is cut into sends."""

    def __init__(self) -> None:
        self.sends: list[bytes] = []

    async def send(self, data: bytes) -> None:
        self.sends.append(bytes(data))


@pytest.mark.anyio
async def test_a_small_answer_goes_out_in_one_send_a_large_one_uncopied() -> None:
    from meshnet_runtime.http_server import _write
    from meshnet_runtime.transports import COALESCE_BYTES

    small = _RecordingStream()
    await _write(small, anyio.Lock(), [b"HTTP/1.1 200 OK\r\n\r\n", memoryview(b"x" * 100)], 5.0)
    assert small.sends == [b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 100]
    large = _RecordingStream()
    body = memoryview(bytes(COALESCE_BYTES))
    await _write(large, anyio.Lock(), [b"head", body], 5.0)
    assert large.sends == [b"head", bytes(body)]


def _stalled_reader(url: str, request: bytes) -> socket.socket:
    """A blocking client socket with a tiny receive buffer that sends
    ``request`` whole and then reads nothing."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(request)
    return sock


def _read_to_eof(sock: socket.socket) -> int:
    """Bytes read until the server closes (bounded by the socket's timeout)."""
    sock.settimeout(30)
    seen = 0
    with contextlib.suppress(ConnectionResetError):
        while data := sock.recv(1 << 20):
            seen += len(data)
    return seen


@pytest.mark.anyio
async def test_a_peer_that_stops_reading_loses_its_connection_after_the_write_timeout() -> None:
    shape = (1, 4 * 1024 * 1024)  # a 16 MiB answer: far more than the socket buffers hold
    async with running(write_timeout=0.5) as (server, url):
        sock = await anyio.to_thread.run_sync(_stalled_reader, url, activation(shape=shape))
        try:
            # The server answers into the full buffers, gives up after the
            # write timeout and closes, while other peers are served.
            with anyio.fail_after(30):
                await wait_until(lambda: server._connections, "the stalled peer's connection")
                other = await connect(parse_endpoint(url))
                await other.send(activation())
                assert (await read_answer(other))[0] == 200
                await other.aclose()
                await wait_until(lambda: not server._connections, "every connection closed")
            seen = await anyio.to_thread.run_sync(_read_to_eof, sock)
            assert 0 < seen < 16 * 1024 * 1024  # part of the answer, then the close
        finally:
            sock.close()
