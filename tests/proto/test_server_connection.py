"""ServerConnection through its public API: bytes in, events out, bytes back.

No sockets: requests are bytes built here, fed whole, byte by byte, or with
the next request behind them, and the same events must come out every way.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import numpy as np
import pytest
import zstandard

from meshnet_proto import (
    NEED_DATA,
    PAUSED,
    ActivationHead,
    ActivationReceived,
    ConnectionClosed,
    EndpointRequest,
    Limits,
    ProtocolError,
    ProtocolErrorReceived,
    SequencingError,
    ServerConnection,
    WireHeaders,
    encode_tensor,
)

SESSION = "5b1e0c2a-9f3d-4c1e-8a7b-0123456789ab"


def tensor(rows: int = 4, width: int = 3) -> np.ndarray:
    return np.arange(rows * width, dtype=np.float32).reshape(1, rows, width) / 7


def headers_for(array: np.ndarray, **fields: object) -> WireHeaders:
    fields.setdefault("session", SESSION)
    fields.setdefault("chunk_index", 0)
    fields.setdefault("chunk_total", 1)
    return WireHeaders.for_array(array, **fields)


def head_lines(pairs: Iterable[tuple[bytes, bytes]]) -> bytes:
    return b"".join(name + b": " + value + b"\r\n" for name, value in pairs)


def activation_request(
    array: np.ndarray | None = None,
    *,
    encoding: str = "identity",
    chunked: bool = False,
    extra: Sequence[tuple[bytes, bytes]] = (),
    target: bytes = b"/forward",
) -> bytes:
    array = tensor() if array is None else array
    body = bytes(encode_tensor(array, encoding=encoding))
    wire = headers_for(array, encoding=encoding)
    head = b"POST " + target + b" HTTP/1.1\r\nHost: node\r\n" + head_lines(wire.to_pairs())
    head += head_lines(extra)
    if chunked:
        # Two chunks, so the body really arrives in pieces.
        half = len(body) // 2
        framed = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (
            half,
            body[:half],
            len(body) - half,
            body[half:],
        )
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + framed
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


def drain(conn: ServerConnection) -> list[object]:
    """Events until the connection wants data, pauses, or closes."""
    events: list[object] = []
    while True:
        event = conn.next_event()
        if event is NEED_DATA or event is PAUSED:
            return events
        events.append(event)
        if isinstance(event, (ConnectionClosed, ProtocolErrorReceived)):
            return events


def feed(conn: ServerConnection, data: bytes, step: int | None = None) -> list[object]:
    """Feed ``data`` in pieces of ``step`` bytes (whole when None), draining
    events after every piece."""
    events: list[object] = []
    step = step or max(len(data), 1)
    for start in range(0, len(data), step):
        conn.receive_data(data[start : start + step])
        events += drain(conn)
    return events


def summary(event: object) -> tuple[object, ...]:
    """A comparable rendering of an event (numpy arrays do not compare)."""
    if isinstance(event, ActivationReceived):
        return (
            "received",
            event.headers,
            event.tensor.dtype.str,
            event.tensor.shape,
            event.tensor.tobytes(),
            event.body_nbytes,
        )
    return ("event", event)


def roundtrip_activation(conn: ServerConnection, data: bytes, step: int | None = None) -> list:
    """Feed one activation; the body is read as soon as the head arrives."""
    return [summary(e) for e in feed(conn, data, step)]


# ------------------------------------------------------------------ parsing


@pytest.mark.parametrize("encoding", ["identity", "zstd"])
@pytest.mark.parametrize("chunked", [False, True])
def test_same_events_whole_bytewise_and_with_trailing_data(encoding: str, chunked: bool) -> None:
    request = activation_request(encoding=encoding, chunked=chunked)
    whole = roundtrip_activation(ServerConnection(), request)
    bytewise = roundtrip_activation(ServerConnection(), request, step=1)
    # A second request pipelined behind the first must not change the first's
    # events, and must wait (PAUSED) until the first is answered.
    pipelined_conn = ServerConnection()
    pipelined = roundtrip_activation(pipelined_conn, request + request)
    assert [kind for kind, *_ in whole] == ["event", "received"]
    assert isinstance(whole[0][1], ActivationHead)
    assert whole == bytewise == pipelined
    assert pipelined_conn.next_event() is PAUSED
    received = whole[1]
    assert received[1].encoding == encoding
    assert received[4] == tensor().tobytes()


def test_pipelined_second_request_follows_the_answer() -> None:
    conn = ServerConnection()
    events = feed(conn, activation_request() + activation_request(tensor(2)))
    assert isinstance(events[-1], ActivationReceived)
    assert conn.next_event() is PAUSED
    conn.send_activation(events[-1].headers, encode_tensor(events[-1].tensor))
    second = drain(conn)
    assert isinstance(second[-1], ActivationReceived)
    assert second[-1].tensor.shape == (1, 2, 3)


def test_received_tensor_is_read_only_and_exact() -> None:
    array = tensor(5, 7)
    events = feed(ServerConnection(), activation_request(array))
    received = events[-1]
    assert isinstance(received, ActivationReceived)
    assert received.body_nbytes == array.nbytes
    assert not received.tensor.flags.writeable
    np.testing.assert_array_equal(received.tensor, array)


def test_large_body_whole_and_in_pieces() -> None:
    # From 256 KiB on the body buffer is uncommitted memory, not a bytearray.
    array = tensor(rows=256, width=300)
    whole = roundtrip_activation(ServerConnection(), activation_request(array))
    assert whole[-1][0] == "received" and whole[-1][-1] == array.nbytes
    assert roundtrip_activation(ServerConnection(), activation_request(array), 4096) == whole


def test_keep_alive_across_many_requests() -> None:
    conn = ServerConnection()
    for index in range(60):
        array = tensor(1 + index % 5)
        events = feed(conn, activation_request(array))
        assert isinstance(events[-1], ActivationReceived)
        out = conn.send_activation(events[-1].headers, encode_tensor(events[-1].tensor))
        assert out[0].startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"connection: close" not in bytes(out[0]).lower()
        assert not conn.should_close
        # Endpoints in between, on the same connection.
        events = feed(conn, b"GET /health HTTP/1.1\r\nHost: n\r\n\r\n")
        assert events == [
            EndpointRequest(
                method="GET",
                path="/health",
                query="",
                headers=((b"host", b"n"),),
                body=b"",
                route="/health",
            )
        ]
        conn.send_response(200, [(b"Content-Type", b"text/plain")], b"ok")
        conn.start_next_cycle()  # already restarted: a no-op
    assert not conn.should_close


def test_100_continue() -> None:
    conn = ServerConnection()
    request = activation_request(extra=[(b"Expect", b"100-continue")])
    head_end = request.index(b"\r\n\r\n") + 4
    events = feed(conn, request[:head_end])
    assert len(events) == 1 and isinstance(events[0], ActivationHead)
    assert events[0].expects_continue
    assert conn.send_continue() == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert conn.send_continue() == b""  # once only
    events = feed(conn, request[head_end:])
    assert isinstance(events[-1], ActivationReceived)


def test_reading_body_tells_a_slow_head_from_a_slow_body() -> None:
    """An endpoint's request is one event, so ``reading_body`` is how a
    driver knows its head is done and the body timeout applies."""
    conn = ServerConnection(routes={"/v1/completions": ("POST",)})
    body = b'{"prompt": "hi"}'
    request = b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nContent-Length: %d\r\n\r\n" % len(body)
    assert feed(conn, request[:10]) == [] and not conn.reading_body  # half a head
    assert feed(conn, request[10:]) == [] and conn.reading_body  # head whole, body to come
    events = feed(conn, body)
    assert isinstance(events[0], EndpointRequest) and not conn.reading_body
    activation = ServerConnection()
    whole = activation_request()
    head_end = whole.index(b"\r\n\r\n") + 4
    assert not activation.reading_body
    assert isinstance(feed(activation, whole[:head_end])[0], ActivationHead)
    assert activation.reading_body
    assert isinstance(feed(activation, whole[head_end:])[-1], ActivationReceived)
    assert not activation.reading_body


def test_no_continue_without_expect() -> None:
    conn = ServerConnection()
    events = feed(conn, activation_request())
    assert not events[0].expects_continue
    assert conn.send_continue() == b""


def test_interim_probe_only_between_a_whole_request_and_its_answer() -> None:
    """``send_interim`` is the driver's probe of a client that half-closed:
    legal once the request is whole and no answer has begun, never else."""
    conn = ServerConnection()
    request = activation_request()
    head_end = request.index(b"\r\n\r\n") + 4
    feed(conn, request[:head_end])
    assert conn.send_interim() == b""  # the body is still to come
    events = feed(conn, request[head_end:])
    assert isinstance(events[-1], ActivationReceived)
    assert conn.send_interim() == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert conn.send_interim() == b"HTTP/1.1 100 Continue\r\n\r\n"  # as often as needed
    conn.send_stream_start(200, [])
    assert conn.send_interim() == b""  # the answer has begun


def test_chunked_body_arriving_in_many_pieces() -> None:
    array = tensor(16, 8)
    body = bytes(encode_tensor(array))
    pieces = [body[i : i + 37] for i in range(0, len(body), 37)]
    framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    request = (
        b"POST /forward HTTP/1.1\r\nHost: n\r\n"
        + head_lines(headers_for(array).to_pairs())
        + b"Transfer-Encoding: chunked\r\n\r\n"
        + framed
    )
    for step in (None, 1, 50):
        events = feed(ServerConnection(), request, step)
        assert isinstance(events[-1], ActivationReceived)
        np.testing.assert_array_equal(events[-1].tensor, array)


def test_decompressor_is_used_for_zstd() -> None:
    conn = ServerConnection(decompressor=zstandard.ZstdDecompressor())
    events = feed(conn, activation_request(encoding="zstd"))
    np.testing.assert_array_equal(events[-1].tensor, tensor())


def test_gateway_input_without_sequencing_headers() -> None:
    array = tensor()
    body = bytes(encode_tensor(array))
    wire = WireHeaders.for_array(array)
    request = (
        b"POST /forward HTTP/1.1\r\nHost: g\r\n"
        + head_lines(wire.to_pairs())
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )
    events = feed(ServerConnection(require_sequencing=False), request)
    assert isinstance(events[-1], ActivationReceived)
    assert events[-1].headers.session is None
    strict = feed(ServerConnection(), request)
    assert strict[-1].error.code == "missing_header"


# ------------------------------------------------------------------ sending


def test_send_activation_passes_the_body_through() -> None:
    conn = ServerConnection()
    events = feed(conn, activation_request())
    body = encode_tensor(np.ascontiguousarray(events[-1].tensor))
    assert isinstance(body, memoryview)
    out = conn.send_activation(events[-1].headers, body)
    assert len(out) == 2
    assert out[1] is body  # the very object: no copy, no join
    head = bytes(out[0])
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Content-Length: %d\r\n" % body.nbytes in head
    assert b"X-Meshnet-Wire: 2\r\n" in head
    assert head.endswith(b"\r\n\r\n")


def test_send_activation_bytes_and_bytearray_pass_through() -> None:
    for make in (bytes, bytearray):
        conn = ServerConnection()
        events = feed(conn, activation_request())
        body = make(events[-1].tensor.tobytes())
        out = conn.send_activation(events[-1].headers, body)
        assert out[1] is body


def test_send_activation_typed_memoryview_is_sent_as_bytes() -> None:
    conn = ServerConnection()
    events = feed(conn, activation_request())
    array = np.array(events[-1].tensor)  # float32, C order, 3-d
    view = memoryview(array)
    out = conn.send_activation(events[-1].headers, view)
    assert out[1].obj is array  # a cast of the same memory, not a copy
    assert bytes(out[1]) == array.tobytes()
    assert b"Content-Length: %d\r\n" % array.nbytes in out[0]


def test_send_activation_refuses_what_a_peer_would_reject() -> None:
    conn = ServerConnection()
    events = feed(conn, activation_request())
    headers = events[-1].headers
    with pytest.raises(ValueError, match="promise"):
        conn.send_activation(headers, b"\x00" * 3)
    with pytest.raises(ValueError, match="bound"):
        conn.send_activation(headers.replace(encoding="zstd"), b"\x00" * (headers.nbytes + 1000))
    with pytest.raises(TypeError):
        conn.send_activation(object(), b"")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        conn.send_activation(headers, "text")  # type: ignore[arg-type]
    strided = memoryview(np.zeros((4, 6), dtype=np.float32)[:, ::2])
    with pytest.raises(ValueError, match="contiguous"):
        conn.send_activation(headers, strided)
    # Nothing was sent: the real answer still can be.
    conn.send_activation(headers, encode_tensor(events[-1].tensor))


def test_send_response_and_204() -> None:
    conn = ServerConnection()
    feed(conn, b"DELETE /sessions/" + SESSION.encode() + b" HTTP/1.1\r\nHost: n\r\n\r\n")
    out = conn.send_response(204)
    assert out == [b"HTTP/1.1 204 No Content\r\n\r\n"]
    assert not conn.should_close
    feed(conn, b"GET /info?x=1 HTTP/1.1\r\nHost: n\r\n\r\n")
    out = conn.send_response(200, [("Content-Type", "application/json")], b"{}")
    assert out == [
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n",
        b"{}",
    ]


def test_send_response_rejects_misuse() -> None:
    conn = ServerConnection()
    feed(conn, b"GET /info HTTP/1.1\r\nHost: n\r\n\r\n")
    with pytest.raises(ValueError):
        conn.send_response(100)
    with pytest.raises(ValueError):
        conn.send_response(True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no body"):
        conn.send_response(204, body=b"x")
    with pytest.raises(ValueError, match="content-length"):
        conn.send_response(200, [(b"Content-Length", b"1")], b"x")
    with pytest.raises(ValueError, match="connection"):
        conn.send_response(200, [("Connection", "close")])
    # h11 refuses an illegal header value: a driver bug, reported as such.
    with pytest.raises(ValueError, match="not a valid response"):
        conn.send_response(200, [(b"X-Bad", b"a\r\nb")])


def test_unknown_status_has_no_reason_phrase() -> None:
    conn = ServerConnection()
    feed(conn, b"GET /info HTTP/1.1\r\nHost: n\r\n\r\n")
    assert conn.send_response(299)[0].startswith(b"HTTP/1.1 299 \r\n")


def test_send_error_after_a_complete_request_keeps_the_connection() -> None:
    conn = ServerConnection()
    events = feed(conn, activation_request())
    assert isinstance(events[-1], ActivationReceived)
    error = SequencingError(
        "position 3 != 0", code="position_mismatch", header="x-meshnet-position"
    )
    out = conn.send_error(error)
    head, body = out
    assert head.startswith(b"HTTP/1.1 409 Conflict\r\n")
    assert b"Content-Type: application/json\r\n" in head
    assert b"connection: close" not in head.lower()
    assert json.loads(body) == {
        "error": {
            "status": 409,
            "code": "position_mismatch",
            "message": "position 3 != 0",
            "header": "x-meshnet-position",
            "hop": None,
        }
    }
    assert not conn.should_close and not conn.needs_drain
    assert isinstance(feed(conn, activation_request())[-1], ActivationReceived)


def test_send_error_retry_after_and_type_check() -> None:
    conn = ServerConnection()
    feed(conn, activation_request())
    with pytest.raises(TypeError):
        conn.send_error(ValueError("no"))  # type: ignore[arg-type]
    from meshnet_proto import CapacityError

    out = conn.send_error(CapacityError("full", code="sessions_full", retry_after=2))
    assert b"Retry-After: 2\r\n" in out[0]
    assert out[0].startswith(b"HTTP/1.1 503 Service Unavailable\r\n")


def test_early_reject_closes_and_asks_for_a_drain() -> None:
    conn = ServerConnection()
    request = activation_request(extra=[(b"Expect", b"100-continue")])
    head_end = request.index(b"\r\n\r\n") + 4
    events = feed(conn, request[:head_end])
    assert isinstance(events[0], ActivationHead)
    # The sequencing check (headers only) says no: answer without the body,
    # and without ever sending 100 Continue.
    out = conn.send_error(SequencingError("unknown", code="session_unknown"))
    assert b"Connection: close\r\n" in out[0]
    assert conn.should_close and conn.needs_drain
    assert conn.next_event() == ConnectionClosed()
    # Whatever the client still sends is drained by the driver, not parsed.
    conn.receive_data(request[head_end:])
    assert conn.next_event() == ConnectionClosed()
    with pytest.raises(RuntimeError, match="closed"):
        conn.send_error(SequencingError("again", code="session_unknown"))


def test_timeout_answer_mid_head() -> None:
    conn = ServerConnection()
    conn.receive_data(b"POST /forward HTTP/1.1\r\nHost:")
    assert conn.next_event() is NEED_DATA
    out = conn.send_error(ProtocolError("too slow", code="request_timeout", status=408))
    assert out[0].startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert b"Connection: close\r\n" in out[0]
    assert conn.should_close and conn.needs_drain


def test_timeout_answer_mid_body() -> None:
    conn = ServerConnection()
    request = activation_request()
    events = feed(conn, request[:-5])
    assert isinstance(events[0], ActivationHead)
    out = conn.send_error(ProtocolError("too slow", code="request_timeout", status=408))
    assert b"Connection: close\r\n" in out[0]
    assert conn.next_event() == ConnectionClosed()


def test_protocol_error_is_sticky() -> None:
    conn = ServerConnection()
    events = feed(conn, b"GET /nowhere HTTP/1.1\r\nHost: n\r\n\r\n")
    assert isinstance(events[0], ProtocolErrorReceived)
    assert conn.should_close
    assert conn.next_event() == ConnectionClosed()
    assert conn.next_event() == ConnectionClosed()
    out = conn.send_error(events[0].error)
    assert b"Connection: close\r\n" in out[0]
    assert conn.next_event() == ConnectionClosed()
    with pytest.raises(RuntimeError):
        conn.send_response(200)


def test_answering_twice_is_a_driver_bug() -> None:
    conn = ServerConnection()
    feed(conn, b"GET /info HTTP/1.1\r\nHost: n\r\nConnection: close\r\n\r\n")
    conn.send_response(200)
    assert conn.should_close
    with pytest.raises(RuntimeError):
        conn.send_response(200)


def test_client_connection_close_and_http10_close_after_answer() -> None:
    for request in (
        b"GET /info HTTP/1.1\r\nHost: n\r\nConnection: close\r\n\r\n",
        b"GET /info HTTP/1.0\r\n\r\n",
    ):
        conn = ServerConnection()
        assert isinstance(feed(conn, request)[0], EndpointRequest)
        out = conn.send_response(200, body=b"{}")
        assert b"connection: close" in out[0].lower()
        assert conn.should_close and not conn.needs_drain
        assert conn.next_event() == ConnectionClosed()


def test_start_next_cycle_only_between_exchanges() -> None:
    conn = ServerConnection()
    conn.start_next_cycle()
    feed(conn, b"GET /info HTTP/1.1\r\nHost: n\r\n\r\n")
    with pytest.raises(RuntimeError, match="no finished exchange"):
        conn.start_next_cycle()


# ------------------------------------------------------------------ end of stream


def test_eof_between_requests_is_a_clean_close() -> None:
    conn = ServerConnection()
    conn.receive_data(b"")
    assert conn.next_event() == ConnectionClosed()
    assert conn.should_close
    assert conn.next_event() == ConnectionClosed()


def test_eof_mid_head_and_mid_body_are_malformed() -> None:
    request = activation_request()
    for cut in (10, len(request) - 3):
        conn = ServerConnection()
        events = feed(conn, request[:cut])
        conn.receive_data(b"")
        events += drain(conn)
        assert isinstance(events[-1], ProtocolErrorReceived)
        assert (events[-1].error.status, events[-1].error.code) == (400, "malformed_request")


# ------------------------------------------------------------------ endpoints and routing


def test_endpoint_requests() -> None:
    conn = ServerConnection()
    events = feed(conn, b"GET /health?deep=1 HTTP/1.1\r\nHost: n\r\n\r\n")
    assert events == [
        EndpointRequest(
            method="GET",
            path="/health",
            query="deep=1",
            headers=((b"host", b"n"),),
            body=b"",
            route="/health",
        )
    ]
    conn.send_response(200)
    events = feed(conn, b"DELETE /sessions/" + SESSION.encode() + b" HTTP/1.1\r\nHost: n\r\n\r\n")
    assert events[0].path == "/sessions/" + SESSION
    assert events[0].route == "/sessions/*"  # the one routing decision, for the app
    conn.send_response(204)
    events = feed(conn, b"DELETE /sessions/x HTTP/1.1\r\nHost: n\r\nContent-Length: 2\r\n\r\nhi")
    assert events[0].body == b"hi"
    conn.send_response(204)
    chunked = b"DELETE /sessions/x HTTP/1.1\r\nHost: n\r\nTransfer-Encoding: chunked\r\n\r\n"
    events = feed(conn, chunked + b"2\r\nhi\r\n3\r\nyou\r\n0\r\n\r\n", step=3)
    assert events[0].body == b"hiyou"


@pytest.mark.parametrize(
    ("request_line", "status", "code"),
    [
        (b"DELETE /sessions/ HTTP/1.1", 404, "not_found"),
        (b"DELETE /sessions/a/b HTTP/1.1", 404, "not_found"),
        (b"GET /sessions HTTP/1.1", 404, "not_found"),
        (b"POST /info HTTP/1.1", 405, "method_not_allowed"),
        (b"HEAD /health HTTP/1.1", 405, "method_not_allowed"),
        (b"PUT /forward HTTP/1.1", 405, "method_not_allowed"),
    ],
)
def test_routing(request_line: bytes, status: int, code: str) -> None:
    events = feed(ServerConnection(), request_line + b"\r\nHost: n\r\nContent-Length: 0\r\n\r\n")
    error = events[0].error
    assert (error.status, error.code) == (status, code)


def test_custom_activation_path_and_routes() -> None:
    conn = ServerConnection(activation_path="/v2/forward", routes={"/status": ("GET",)})
    events = feed(conn, activation_request(target=b"/v2/forward"))
    assert isinstance(events[-1], ActivationReceived)
    conn.send_activation(events[-1].headers, encode_tensor(events[-1].tensor))
    assert isinstance(feed(conn, b"GET /status HTTP/1.1\r\nHost: n\r\n\r\n")[0], EndpointRequest)
    conn.send_response(200)
    events = feed(conn, b"GET /health HTTP/1.1\r\nHost: n\r\n\r\n")
    assert events[0].error.code == "not_found"


@pytest.mark.parametrize(
    ("target", "route"),
    [
        (b"/v1/models", "/v1/models"),  # an exact key before the catch-all
        (b"/v1/embeddings", "/v1/**"),
        (b"/v1/audio/speech", "/v1/**"),  # any depth
        (b"/v1/a/", "/v1/**"),
    ],
)
def test_a_double_star_route_takes_every_path_under_its_prefix(target: bytes, route: str) -> None:
    routes = {"/v1/models": ("GET",), "/v1/**": ("GET",)}
    conn = ServerConnection(routes=routes)
    events = feed(conn, b"GET " + target + b" HTTP/1.1\r\nHost: n\r\n\r\n")
    assert isinstance(events[0], EndpointRequest) and events[0].route == route


@pytest.mark.parametrize("target", [b"/v1/", b"/v1", b"/v2/x"])
def test_a_double_star_route_needs_a_rest_under_its_prefix(target: bytes) -> None:
    conn = ServerConnection(routes={"/v1/**": ("GET",)})
    events = feed(conn, b"GET " + target + b" HTTP/1.1\r\nHost: n\r\n\r\n")
    assert events[0].error.code == "not_found"


def test_endpoint_body_cap() -> None:
    conn = ServerConnection(max_endpoint_body=4)
    events = feed(conn, b"DELETE /sessions/x HTTP/1.1\r\nHost: n\r\nContent-Length: 4\r\n\r\nabcd")
    assert events[0].body == b"abcd"


# ------------------------------------------------------------------ credentials


def test_token_protects_everything_but_health() -> None:
    conn = ServerConnection(token="s3cret-token")
    events = feed(conn, b"GET /health HTTP/1.1\r\nHost: n\r\n\r\n")
    assert isinstance(events[0], EndpointRequest)
    conn.send_response(200)
    events = feed(
        conn, b"GET /info HTTP/1.1\r\nHost: n\r\nAuthorization: Bearer s3cret-token\r\n\r\n"
    )
    assert isinstance(events[0], EndpointRequest)
    conn.send_response(200)
    request = activation_request(extra=[(b"authorization", b"bearer  s3cret-token")])
    assert isinstance(feed(conn, request)[-1], ActivationReceived)


@pytest.mark.parametrize("query", ["deep=1", "deep=true", "x=1&deep=1"])
def test_deep_health_needs_the_token(query: str) -> None:
    """wire-2 §7: only a plain /health is open; the deep one shows the chain."""
    conn = ServerConnection(token="s3cret-token")
    events = feed(conn, f"GET /health?{query} HTTP/1.1\r\nHost: n\r\n\r\n".encode())
    assert (events[0].error.status, events[0].error.code) == (401, "unauthorized")
    conn = ServerConnection(token="s3cret-token")
    events = feed(conn, f"GET /health?{query} HTTP/1.1\r\nHost: n\r\n"
                        "Authorization: Bearer s3cret-token\r\n\r\n".encode())  # fmt: skip
    assert isinstance(events[0], EndpointRequest)
    conn = ServerConnection(token="s3cret-token")
    events = feed(conn, b"GET /health?deep=0 HTTP/1.1\r\nHost: n\r\n\r\n")
    assert isinstance(events[0], EndpointRequest)


@pytest.mark.parametrize(
    "authorization",
    [
        [],
        [b"Bearer wrong"],
        [b"Basic s3cret-token"],
        [b"Bearer s3cret-token", b"Bearer s3cret-token"],
        [b"Bearer s3cret-tokenX"],
        [b"Bearer"],
    ],
)
def test_bad_credentials_are_401_without_a_hint(authorization: list[bytes]) -> None:
    conn = ServerConnection(token="s3cret-token")
    extra = [(b"Authorization", value) for value in authorization]
    events = feed(conn, activation_request(extra=extra))
    error = events[0].error
    assert (error.status, error.code, error.header) == (401, "unauthorized", "authorization")
    out = b"".join(bytes(piece) for piece in conn.send_error(error))
    assert b"s3cret" not in out
    assert b"WWW-Authenticate: Bearer\r\n" in out


# ------------------------------------------------------------------ limits and configuration


def test_header_limit_is_the_same_whole_or_bytewise() -> None:
    limits = Limits(max_header_bytes=1024)
    request = activation_request(extra=[(b"X-Padding", b"p" * 1100)])
    for step in (None, 1, 100):
        events = feed(ServerConnection(limits=limits), request, step)
        errors = [e for e in events if isinstance(e, ProtocolErrorReceived)]
        assert len(errors) == 1
        error = errors[0].error
        assert (error.status, error.code) == (431, "header_block_too_large")


def test_constructor_validation() -> None:
    with pytest.raises(ValueError):
        ServerConnection(token="")
    with pytest.raises(ValueError):
        ServerConnection(activation_path="forward")
    with pytest.raises(ValueError):
        ServerConnection(max_endpoint_body=-1)


# ------------------------------------------------------------------ events


def test_events_validate_their_fields() -> None:
    wire = headers_for(tensor())
    with pytest.raises(TypeError):
        ActivationHead(headers="x", expects_continue=False)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ActivationHead(headers=wire, expects_continue=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ActivationReceived(headers=None, tensor=tensor(), body_nbytes=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ActivationReceived(headers=wire, tensor=[1], body_nbytes=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ActivationReceived(headers=wire, tensor=tensor(), body_nbytes=-1)
    good = {"method": "GET", "path": "/x", "query": "", "headers": (), "body": b""}
    for field, bad in [
        ("method", ""),
        ("path", "x"),
        ("query", None),
        ("headers", [(b"a", b"b")]),
        ("headers", ((b"a", "b"),)),
        ("body", "x"),
        ("route", None),
    ]:
        with pytest.raises((TypeError, ValueError)):
            EndpointRequest(**{**good, field: bad})
    with pytest.raises(TypeError):
        ProtocolErrorReceived(error=ValueError("x"))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ActivationHead(wire, False)  # type: ignore[misc]  # keyword-only
    assert repr(NEED_DATA) == "NEED_DATA" and repr(PAUSED) == "PAUSED"


def test_answers_to_head_have_no_body() -> None:
    # Found by the fuzzer: h11 refuses a body after HEAD, so an error answer
    # to a HEAD request must leave its body out (the headers still say its size).
    conn = ServerConnection()
    events = feed(conn, b"HEAD /health HTTP/1.1\r\nHost: n\r\n\r\n")
    out = conn.send_error(events[0].error)
    assert len(out) == 1
    assert out[0].startswith(b"HTTP/1.1 405 Method Not Allowed\r\n")
    conn = ServerConnection(routes={"/health": ("GET", "HEAD")})
    feed(conn, b"HEAD /health HTTP/1.1\r\nHost: n\r\n\r\n")
    assert conn.send_response(200, body=b"ok") == [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n"]
    feed(conn, b"GET /health HTTP/1.1\r\nHost: n\r\n\r\n")
    assert conn.send_response(200, body=b"ok")[1] == b"ok"


@pytest.mark.parametrize(
    ("target", "expect_continue"),
    [
        (b"/forward", False),
        (b"/forward?replay=1", True),
        (b"/forward?a=b&replay=1&x", False),
        (b"/forward?replay=10", False),
        (b"/forward?kv=1", False),
    ],
)
def test_activation_events_equal_the_publicly_built_ones(
    target: bytes, expect_continue: bool
) -> None:
    """The connection builds its two activation events without checking
    again what it made itself: each must be what the public constructor
    builds from the same values (replay and kv_import read off the query)."""
    array = tensor()
    extra = [(b"Expect", b"100-continue")] if expect_continue else []
    if b"kv=1" in target:
        # A KV import: [layers, 2, batch, kv_heads, positions, head_dim] and
        # its two headers (wire-2 §3.11), whose values are checked for form.
        array = np.zeros((1, 2, 1, 1, 2, 3), dtype=np.float32)
        extra += [(b"X-Meshnet-Position", b"2"), (b"X-Meshnet-Kv-Checksum", b"0" * 16),
                  (b"X-Meshnet-Kv-Fingerprint", b"0" * 32)]  # fmt: skip
    conn = ServerConnection()
    conn.receive_data(activation_request(array, target=target, extra=extra))
    head, received = conn.next_event(), conn.next_event()
    assert isinstance(head, ActivationHead) and isinstance(received, ActivationReceived)
    query = target.decode().partition("?")[2]
    assert head == ActivationHead(
        headers=head.headers, expects_continue=expect_continue, query=query
    )
    public = ActivationReceived(
        headers=head.headers, tensor=received.tensor, body_nbytes=array.nbytes, query=query
    )
    assert received == public  # the same tensor object: no array comparison
    assert (received.replay, received.kv_import) == (head.replay, head.kv_import)
    assert head.replay == (target.endswith(b"replay=1") or b"replay=1&" in target)
    assert head.kv_import == (b"kv=1" in target)
    assert np.array_equal(received.tensor, array)
