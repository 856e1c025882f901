"""Streamed answers (server-sent events): the core frames them, the serving
loop writes them and cancels their producer when the client leaves."""

from __future__ import annotations

import anyio
import h11
import pytest

from meshnet_proto import PAUSED, EndpointRequest, ServerConnection
from meshnet_runtime.http_server import HttpServer, Reply, StreamReply
from meshnet_runtime.transports import listen

ROUTES = {"/events": ("POST",), "/plain": ("GET",)}


def request(http: bytes = b"HTTP/1.1", extra: bytes = b"") -> bytes:
    return b"POST /events " + http + b"\r\nHost: x\r\nContent-Length: 2\r\n" + extra + b"\r\n{}"


def parse_answer(data: bytes) -> tuple[h11.Response, bytes]:
    client = h11.Connection(h11.CLIENT)
    headers = [("Host", "x"), ("Content-Length", "2")]
    client.send(h11.Request(method="POST", target="/events", headers=headers))
    client.send(h11.Data(data=b"{}"))
    client.send(h11.EndOfMessage())
    client.receive_data(data)
    response = client.next_event()
    assert isinstance(response, h11.Response)
    body = b""
    while True:
        event = client.next_event()
        if isinstance(event, h11.Data):
            body += event.data
        else:
            assert isinstance(event, h11.EndOfMessage), event
            return response, body


def complete_request(conn: ServerConnection, data: bytes) -> EndpointRequest:
    conn.receive_data(data)
    event = conn.next_event()
    assert isinstance(event, EndpointRequest)
    assert conn.next_event() is PAUSED
    return event


def test_streamed_answer_is_chunked_and_keeps_the_connection() -> None:
    conn = ServerConnection(routes=ROUTES)
    complete_request(conn, request() + request())  # a pipelined second request behind
    out = [conn.send_stream_start(200, [(b"content-type", b"text/event-stream")])]
    out += conn.send_stream_data(b"data: 1\n\n")
    out += conn.send_stream_data(b"")  # nothing: an empty chunk would end the body
    out += conn.send_stream_data(memoryview(b"data: 2\n\n"))
    out += conn.send_stream_end()
    wire = b"".join(bytes(part) for part in out)
    assert b"transfer-encoding: chunked" in wire.lower()
    response, body = parse_answer(wire)
    assert response.status_code == 200
    assert body == b"data: 1\n\ndata: 2\n\n"
    assert not conn.should_close
    assert isinstance(conn.next_event(), EndpointRequest)  # the pipelined one, next


def test_streamed_answer_to_http_1_0_closes_to_end_the_body() -> None:
    conn = ServerConnection(routes=ROUTES)
    complete_request(conn, request(b"HTTP/1.0"))
    head = conn.send_stream_start(200)
    assert b"chunked" not in head.lower()
    assert b"".join(conn.send_stream_data(b"abc")) == b"abc"
    conn.send_stream_end()
    assert conn.should_close


def test_stream_misuse_is_refused() -> None:
    conn = ServerConnection(routes=ROUTES)
    with pytest.raises(RuntimeError):
        conn.send_stream_start(200)  # no request yet
    with pytest.raises(RuntimeError):
        conn.send_stream_data(b"x")
    with pytest.raises(RuntimeError):
        conn.send_stream_end()
    complete_request(conn, request())
    with pytest.raises(ValueError):
        conn.send_stream_start(204)
    with pytest.raises(ValueError):
        conn.send_stream_start(200, [(b"Content-Length", b"3")])
    with pytest.raises(ValueError, match="not a valid response"):
        conn.send_stream_start(200, [(b"Bad Name", b"x")])  # h11 refuses the header
    conn.send_stream_start(200)
    with pytest.raises(RuntimeError):
        conn.send_stream_start(200)  # answering twice
    with pytest.raises(RuntimeError):
        conn.send_response(200)


class _App:
    """Streams numbered events until cancelled or ``count`` are out."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.sent = 0
        self.finished = anyio.Event()
        self.cancelled = False

    async def handle_activation_head(self, event: object, ctx: object) -> None:
        raise AssertionError("no activations here")

    async def handle_activation(self, event: object, ctx: object) -> Reply:
        raise AssertionError("no activations here")

    def cancel_on_disconnect(self, event: object) -> bool:
        return False

    async def handle_endpoint(self, event: EndpointRequest, ctx: object) -> Reply | StreamReply:
        if event.path == "/plain":
            return Reply.json(200, {"sent": self.sent, "cancelled": self.cancelled})

        async def produce(send: object) -> None:
            try:
                for index in range(self.count):
                    await send(b"data: %d\n\n" % index)  # type: ignore[operator]
                    self.sent += 1
                    await anyio.sleep(0.001)  # stall under test: a slow producer
            except anyio.get_cancelled_exc_class():
                self.cancelled = True
                raise
            finally:
                self.finished.set()

        return StreamReply(200, [(b"content-type", b"text/event-stream")], produce)


async def _serve(app: _App):  # type: ignore[no-untyped-def]
    server = HttpServer(app, lambda: ServerConnection(routes=ROUTES))  # type: ignore[arg-type]
    bound = await listen(host="127.0.0.1", port=0)
    return server, bound


@pytest.mark.anyio
async def test_whole_stream_then_keep_alive_over_a_socket() -> None:
    app = _App(count=5)
    server, bound = await _serve(app)
    async with anyio.create_task_group() as tg:
        url = await tg.start(server.serve, bound)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with anyio.fail_after(20):
            stream = await anyio.connect_tcp(host, int(port))
            await stream.send(request() + b"GET /plain HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while b'"sent"' not in data or not data.endswith(b"}"):
                data += await stream.receive()
            await stream.aclose()
        first, _, rest = data.partition(b"0\r\n\r\n")  # the chunked body's last chunk
        _, body = parse_answer(first + b"0\r\n\r\n")
        assert body == b"".join(b"data: %d\n\n" % i for i in range(5))
        assert b'"sent":5' in rest and b'"cancelled":false' in rest
        server.request_shutdown()


@pytest.mark.anyio
async def test_client_leaving_mid_stream_cancels_the_producer() -> None:
    app = _App(count=100_000)  # would run for minutes unless cancelled
    server, bound = await _serve(app)
    async with anyio.create_task_group() as tg:
        url = await tg.start(server.serve, bound)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with anyio.fail_after(20):
            stream = await anyio.connect_tcp(host, int(port))
            await stream.send(request())
            data = b""
            while b"data: 3\n" not in data:
                data += await stream.receive()
            await stream.aclose()
            await app.finished.wait()
        assert app.cancelled
        assert app.sent < app.count
        server.request_shutdown()


@pytest.mark.anyio
async def test_client_leaving_while_the_producer_is_silent_cancels_it() -> None:
    """No write fails when nothing is written (a long prefill): after the
    client's end of stream the loop writes the reply's heartbeat itself,
    and the reset that meets it tells a closed socket from a half-close."""
    started, finished = anyio.Event(), anyio.Event()
    cancelled = []

    class Silent(_App):
        async def handle_endpoint(self, event: EndpointRequest, ctx: object) -> StreamReply:
            async def produce(send: object) -> None:
                try:
                    await send(b"data: first\n\n")  # type: ignore[operator]
                    started.set()
                    await anyio.sleep_forever()
                except anyio.get_cancelled_exc_class():
                    cancelled.append(True)
                    raise
                finally:
                    finished.set()

            return StreamReply(200, [], produce, heartbeat=b": ping\n\n")

    server, bound = await _serve(Silent(count=0))
    async with anyio.create_task_group() as tg:
        url = await tg.start(server.serve, bound)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with anyio.fail_after(20):
            stream = await anyio.connect_tcp(host, int(port))
            await stream.send(request())
            await started.wait()
            await stream.aclose()
            await finished.wait()
        assert cancelled == [True]
        server.request_shutdown()


class _Watched(_App):
    """POST /events works until cancelled; the app asks to be cancelled on departure."""

    def __init__(self) -> None:
        super().__init__(count=0)
        self.started = anyio.Event()
        self.release = anyio.Event()

    def cancel_on_disconnect(self, event: EndpointRequest) -> bool:
        return event.path == "/events"

    async def handle_endpoint(self, event: EndpointRequest, ctx: object) -> Reply | StreamReply:
        if event.path == "/plain":
            return Reply.json(200, {"cancelled": self.cancelled})
        self.started.set()
        try:
            await self.release.wait()
        except anyio.get_cancelled_exc_class():
            self.cancelled = True
            raise
        finally:
            self.finished.set()
        return Reply.json(200, {"done": True})


@pytest.mark.anyio
async def test_watched_request_is_cancelled_when_its_client_leaves() -> None:
    app = _Watched()
    server, bound = await _serve(app)
    async with anyio.create_task_group() as tg:
        url = await tg.start(server.serve, bound)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with anyio.fail_after(20):
            stream = await anyio.connect_tcp(host, int(port))
            await stream.send(request())
            await app.started.wait()
            await stream.aclose()
            await app.finished.wait()
        assert app.cancelled
        server.request_shutdown()


@pytest.mark.anyio
async def test_watched_request_with_a_pipelined_next_one_answers_both() -> None:
    app = _Watched()
    server, bound = await _serve(app)
    async with anyio.create_task_group() as tg:
        url = await tg.start(server.serve, bound)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with anyio.fail_after(20):
            stream = await anyio.connect_tcp(host, int(port))
            await stream.send(request() + b"GET /plain HTTP/1.1\r\nHost: x\r\n\r\n")
            await app.started.wait()
            app.release.set()
            data = b""
            while data.count(b"HTTP/1.1 200") < 2 or not data.endswith(b"}"):
                data += await stream.receive()
            await stream.aclose()
        assert b'{"done":true}' in data and b'{"cancelled":false}' in data
        server.request_shutdown()
