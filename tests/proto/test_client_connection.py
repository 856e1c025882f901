"""ClientConnection through its public API, against a ServerConnection and
against hand-written (often hostile) responses. No sockets."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zstandard

from meshnet_proto import (
    NEED_DATA,
    ActivationReceived,
    ActivationResponse,
    CapacityError,
    ClientConnection,
    ConnectionClosed,
    DownstreamError,
    EndpointRequest,
    ErrorResponse,
    Limits,
    Response,
    SequencingError,
    ServerConnection,
    WireHeaders,
    encode_tensor,
)

SESSION = "5b1e0c2a-9f3d-4c1e-8a7b-0123456789ab"
ARRAY = (np.arange(40, dtype=np.float32).reshape(1, 10, 4) - 7) / 3
# The codec decides which header a bad frame names; the client only relays it.
ANY_HEADER = "<any>"
WIRE = WireHeaders.for_array(ARRAY, session=SESSION, chunk_index=2, chunk_total=5, position=20)


def pump(pieces: list, into: ServerConnection | ClientConnection) -> None:
    for piece in pieces:
        into.receive_data(bytes(piece))


def serve_one(client: ClientConnection, server: ServerConnection, pieces: list) -> object:
    """Deliver a request to ``server`` and return its first complete event."""
    pump(pieces, server)
    while True:
        event = server.next_event()
        if not isinstance(event, type(None)) and type(event).__name__ != "ActivationHead":
            return event


def response_bytes(
    status: bytes = b"200 OK",
    pairs: list[tuple[bytes, bytes]] | None = None,
    body: bytes = b"",
    *,
    length: bool = True,
) -> bytes:
    pairs = WIRE.to_pairs() if pairs is None else pairs
    lines = [b"HTTP/1.1 " + status] + [name + b": " + value for name, value in pairs]
    if length:
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def answer(client: ClientConnection, data: bytes, *, eof: bool = False) -> object:
    client.receive_data(data)
    if eof:
        client.receive_data(b"")
    return client.next_event()


def sent_activation(client: ClientConnection | None = None) -> ClientConnection:
    client = client or ClientConnection()
    client.send_activation(WIRE, encode_tensor(ARRAY))
    return client


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("encoding", ["identity", "zstd"])
def test_roundtrip_with_a_server_keep_alive(encoding: str) -> None:
    client = ClientConnection(host="node-2:8000", token="t0k")
    server = ServerConnection(token="t0k")
    wire = WIRE.replace(encoding=encoding)
    for _ in range(55):
        out = client.send_activation(wire, encode_tensor(ARRAY, encoding=encoding))
        assert b"Host: node-2:8000\r\n" in out[0]
        assert b"Authorization: Bearer t0k\r\n" in out[0]
        received = serve_one(client, server, out)
        assert isinstance(received, ActivationReceived)
        pump(
            server.send_activation(
                received.headers, encode_tensor(received.tensor, encoding=encoding)
            ),
            client,
        )
        response = client.next_event()
        assert isinstance(response, ActivationResponse)
        assert response.headers == wire
        assert response.tensor is not None
        assert response.tensor.tobytes() == ARRAY.tobytes()
        assert client.reusable
        client.start_next_cycle()  # no-op between exchanges
    assert client.next_event() is NEED_DATA


def test_send_activation_passes_the_body_through() -> None:
    client = ClientConnection()
    body = encode_tensor(ARRAY)
    out = client.send_activation(WIRE, body, path="/v2/forward")
    assert out[0].startswith(b"POST /v2/forward HTTP/1.1\r\n")
    assert out[1] is body
    assert b"Authorization" not in out[0]
    with pytest.raises(TypeError):
        ClientConnection().send_activation("x", body)  # type: ignore[arg-type]


def test_relay_without_decoding_passes_the_downstream_body_upstream() -> None:
    client = ClientConnection(decode=False)
    client.send_activation(WIRE, encode_tensor(ARRAY, encoding="zstd"))
    zbody = bytes(encode_tensor(ARRAY, encoding="zstd"))
    response = answer(
        client, response_bytes(pairs=WIRE.replace(encoding="zstd").to_pairs(), body=zbody)
    )
    assert isinstance(response, ActivationResponse)
    assert response.tensor is None
    assert bytes(response.body) == zbody
    assert response.body.readonly
    # The node relays it unchanged: the same buffer object goes out.
    server = ServerConnection()
    pump(
        ClientConnection().send_activation(WIRE, encode_tensor(ARRAY)),
        server,
    )
    while not isinstance(server.next_event(), ActivationReceived):
        pass
    out = server.send_activation(response.headers, response.body)
    assert out[1] is response.body


def test_chunked_and_100_continue_responses_are_read() -> None:
    client = sent_activation()
    body = ARRAY.tobytes()
    data = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        + response_bytes(pairs=[*WIRE.to_pairs(), (b"Transfer-Encoding", b"chunked")], length=False)
        + b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (10, body[:10], len(body) - 10, body[10:])
    )
    for step in (len(data), 1):
        client = sent_activation()
        events = []
        for start in range(0, len(data), step):
            client.receive_data(data[start : start + step])
            event = client.next_event()
            if event is not NEED_DATA:
                events.append(event)
        assert len(events) == 1
        assert events[0].tensor.tobytes() == body


def test_response_without_sequencing_headers_is_held_to_gateway_rules() -> None:
    wire = WireHeaders.for_array(ARRAY, position=0)
    client = sent_activation()
    response = answer(client, response_bytes(pairs=wire.to_pairs(), body=ARRAY.tobytes()))
    assert response.headers.session is None


def test_decompressor_and_decode_false_identity() -> None:
    client = sent_activation(ClientConnection(decompressor=zstandard.ZstdDecompressor()))
    zwire = WIRE.replace(encoding="zstd")
    zbody = bytes(encode_tensor(ARRAY, encoding="zstd"))
    assert answer(client, response_bytes(pairs=zwire.to_pairs(), body=zbody)).tensor.shape == (
        1,
        10,
        4,
    )
    client = sent_activation(ClientConnection(decode=False))
    response = answer(client, response_bytes(body=ARRAY.tobytes()))
    assert response.tensor is None and bytes(response.body) == ARRAY.tobytes()


# ------------------------------------------------------------------ other endpoints


def test_send_request_and_response() -> None:
    client = ClientConnection(token="t0k")
    server = ServerConnection(token="t0k")
    out = client.send_request("GET", "/info")
    assert b"Content-Length" not in out[0]
    request = serve_one(client, server, out)
    assert isinstance(request, EndpointRequest) and request.path == "/info"
    info = json.dumps({"role": "node", "wire": 2}).encode()
    pump(server.send_response(200, [(b"Content-Type", b"application/json")], info), client)
    response = client.next_event()
    assert isinstance(response, Response)
    assert json.loads(response.body) == {"role": "node", "wire": 2}
    assert (b"content-type", b"application/json") in response.headers
    # DELETE passes through the chain: 204 without a body.
    out = client.send_request("DELETE", "/sessions/" + SESSION)
    assert isinstance(serve_one(client, server, out), EndpointRequest)
    pump(server.send_response(204), client)
    assert client.next_event() == Response(status=204, headers=(), body=b"")


def test_send_request_headers() -> None:
    client = ClientConnection(token="t0k")
    out = client.send_request(
        "POST",
        "/x",
        [("Host", "elsewhere"), (b"Authorization", b"Bearer other")],
        body=memoryview(b"abc"),
    )
    head = out[0]
    assert b"Host: elsewhere\r\n" in head and b"Host: downstream" not in head
    assert b"Bearer other" in head and b"Bearer t0k" not in head
    assert b"Content-Length: 3\r\n" in head
    assert bytes(out[1]) == b"abc"
    out = ClientConnection().send_request("POST", "/x")
    assert b"Content-Length: 0\r\n" in out[0]


def test_response_until_close_and_head() -> None:
    client = ClientConnection()
    client.send_request("GET", "/metrics")
    data = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nmetric 1\n"
    response = answer(client, data, eof=True)
    assert response.body == b"metric 1\n"
    assert not client.reusable
    assert client.next_event() == ConnectionClosed()
    client = ClientConnection()
    client.send_request("HEAD", "/health")
    assert answer(client, b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n").body == b""
    assert client.reusable


# ------------------------------------------------------------------ errors relayed


def test_error_response_is_relayed_with_hop() -> None:
    client = sent_activation(ClientConnection(hop="http://node-3:8000"))
    server = ServerConnection()
    error = SequencingError(
        "chunk 3 waited", code="chunk_wait_timeout", header="x-meshnet-chunk-index"
    )
    pump(ClientConnection().send_activation(WIRE, encode_tensor(ARRAY)), server)
    server.next_event()
    server.next_event()
    response = answer(client, b"".join(bytes(p) for p in server.send_error(error)))
    assert isinstance(response, ErrorResponse)
    assert response.status == 409
    assert response.error == {
        "status": 409,
        "code": "chunk_wait_timeout",
        "message": "chunk 3 waited",
        "header": "x-meshnet-chunk-index",
        "hop": None,
    }
    assert client.reusable  # the server kept the connection open
    relayed = response.to_error(hop="http://node-3:8000")
    assert isinstance(relayed, DownstreamError)
    assert (relayed.status, relayed.code, relayed.header, relayed.hop) == (
        409,
        "chunk_wait_timeout",
        "x-meshnet-chunk-index",
        "http://node-3:8000",
    )


def test_deeper_hop_and_retry_after_are_kept() -> None:
    client = sent_activation()
    error = CapacityError("full", code="sessions_full", hop="http://deep:1", retry_after=3)
    body = json.dumps(error.to_dict()).encode()
    data = response_bytes(
        b"503 Service Unavailable",
        [(b"Content-Type", b"application/json"), (b"Retry-After", b"3")],
        body,
    )
    response = answer(client, data)
    assert response.retry_after == 3
    relayed = response.to_error(hop="http://mine:1")
    assert relayed.hop == "http://deep:1"
    assert relayed.retry_after == 3


@pytest.mark.parametrize(
    "body",
    [
        b"<html>502 Bad Gateway</html>",
        b'{"error": "nope"}',
        b'{"error": {"code": 5, "message": "x"}}',
        b'{"error": {"code": "x", "message": "y", "hop": 7}}',
        b"[1, 2]",
        b"\xff\xfe",
        b"",
    ],
)
def test_non_spec_error_bodies_get_a_synthesised_error(body: bytes) -> None:
    client = ClientConnection()
    client.send_request("GET", "/health")
    response = answer(client, response_bytes(b"502 Bad Gateway", [(b"Retry-After", b"soon")], body))
    assert isinstance(response, ErrorResponse)
    assert response.raw == body
    assert response.retry_after is None
    assert response.error["status"] == 502
    assert response.error["code"] == "downstream_bad_response"
    assert response.error["hop"] is None
    relayed = response.to_error(hop="http://n:1")
    assert (relayed.status, relayed.code, relayed.hop) == (
        502,
        "downstream_bad_response",
        "http://n:1",
    )


@pytest.mark.parametrize(
    ("status", "relayed"),
    [(b"500 Oops", 502), (b"404 Not Found", 404), (b"503 Busy", 503), (b"501 No", 501)],
)
def test_a_500_without_a_spec_body_is_garbage_502(status: bytes, relayed: int) -> None:
    # A relaying node must not answer 500 (its own bug) for a downstream's garbage.
    client = ClientConnection()
    client.send_request("GET", "/health")
    response = answer(client, response_bytes(status, [], b"<html>oops</html>"))
    assert isinstance(response, ErrorResponse)
    assert response.status == response.error["status"] == relayed
    assert response.error["code"] == "downstream_bad_response"
    assert response.to_error(hop="http://n:1").status == relayed


def test_a_500_with_a_spec_body_is_relayed_as_500() -> None:
    client = ClientConnection()
    client.send_request("GET", "/health")
    body = (
        b'{"error":{"status":500,"code":"internal_error","message":"m","header":null,"hop":null}}'
    )
    response = answer(client, response_bytes(b"500 Internal Server Error", [], body))
    assert isinstance(response, ErrorResponse)
    assert (response.status, response.error["code"]) == (500, "internal_error")


# ------------------------------------------------------------------ garbage and cut-offs


def bad(client: ClientConnection, data: bytes, *, eof: bool = False) -> DownstreamError:
    client.receive_data(data)
    if eof:
        client.receive_data(b"")
    with pytest.raises(DownstreamError) as caught:
        client.next_event()
    # Sticky: the same error again, and the connection is spent.
    with pytest.raises(DownstreamError) as again:
        client.next_event()
    assert again.value is caught.value
    assert not client.reusable
    return caught.value


@pytest.mark.parametrize(
    ("data", "header"),
    [
        (b"SMTP READY\r\n\r\n", None),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", None),
        (
            response_bytes(pairs=[(b"Content-Type", b"application/json")], body=b"{}"),
            "content-type",
        ),
        (
            response_bytes(pairs=WIRE.replace(dtype="float16").to_pairs(), body=ARRAY.tobytes()),
            "content-length",
        ),
        (response_bytes(b"201 Created"), None),
        (response_bytes(b"302 Found"), None),
        (response_bytes(b"600 Beyond"), None),
        (
            response_bytes(pairs=WIRE.replace(encoding="zstd").to_pairs(), body=b"garbage"),
            ANY_HEADER,
        ),
        (
            response_bytes(
                pairs=[*WIRE.to_pairs(), (b"X-Meshnet-Dtype", b"float32")], body=ARRAY.tobytes()
            ),
            "x-meshnet-dtype",
        ),
    ],
    ids=[
        "not_http",
        "bad_length",
        "json_200",
        "length_mismatch",
        "201",
        "302",
        "600",
        "bad_zstd",
        "dup_header",
    ],
)
def test_garbage_responses_are_502(data: bytes, header: str | None) -> None:
    error = bad(sent_activation(ClientConnection(hop="http://n2:1")), data)
    assert (error.status, error.code, error.hop) == (502, "downstream_bad_response", "http://n2:1")
    if header is not ANY_HEADER:
        assert error.header == header


def test_oversize_responses_are_refused_before_reading() -> None:
    # Content-Length over the tensor's bound.
    client = sent_activation()
    zwire = WIRE.replace(encoding="zstd")
    error = bad(
        client,
        response_bytes(pairs=zwire.to_pairs(), body=b"").replace(
            b"Content-Length: 0", b"Content-Length: 999999999"
        ),
    )
    assert error.header == "content-length"
    # Chunked body streaming past the bound.
    client = sent_activation()
    chunk = b"x" * (ARRAY.nbytes + 1)
    pairs = [*WIRE.to_pairs(), (b"Transfer-Encoding", b"chunked")]
    error = bad(
        client, response_bytes(pairs=pairs, length=False) + b"%x\r\n%s\r\n" % (len(chunk), chunk)
    )
    assert "bound" in error.message
    # An error body over the cap.
    client = ClientConnection(max_response_body=100)
    client.send_request("GET", "/info")
    error = bad(client, response_bytes(b"500 Oops", [], b"e" * 101))
    assert error.code == "downstream_bad_response"
    # A body without a length, until close, over the cap.
    client = ClientConnection(max_response_body=100)
    client.send_request("GET", "/metrics")
    bad(client, b"HTTP/1.1 200 OK\r\n\r\n" + b"m" * 150)


def test_oversize_response_head_is_refused() -> None:
    client = sent_activation(ClientConnection(limits=Limits(max_header_bytes=1024)))
    data = response_bytes(pairs=[*WIRE.to_pairs(), (b"X-Pad", b"p" * 2000)], body=ARRAY.tobytes())
    client.receive_data(data[:1500])
    with pytest.raises(DownstreamError) as caught:
        client.next_event()
    assert caught.value.code == "downstream_bad_response"


def test_truncated_responses_are_unreachable() -> None:
    full = response_bytes(body=ARRAY.tobytes())
    for cut in (0, 20, len(full) - 7):
        error = bad(sent_activation(ClientConnection(hop="http://n2:1")), full[:cut], eof=True)
        assert (error.status, error.code, error.hop) == (
            502,
            "downstream_unreachable",
            "http://n2:1",
        )


def test_decode_false_still_checks_identity_size() -> None:
    client = sent_activation(ClientConnection(decode=False))
    pairs = [*WIRE.to_pairs(), (b"Transfer-Encoding", b"chunked")]
    short = ARRAY.tobytes()[:-4]
    data = response_bytes(pairs=pairs, length=False) + b"%x\r\n%s\r\n0\r\n\r\n" % (
        len(short),
        short,
    )
    assert bad(client, data).code == "downstream_bad_response"


# ------------------------------------------------------------------ connection lifecycle


def test_connection_close_response_is_not_reusable() -> None:
    client = sent_activation()
    data = response_bytes(pairs=[*WIRE.to_pairs(), (b"Connection", b"close")], body=ARRAY.tobytes())
    assert isinstance(answer(client, data), ActivationResponse)
    assert not client.reusable
    assert client.next_event() == ConnectionClosed()
    with pytest.raises(RuntimeError, match="not reusable"):
        client.start_next_cycle()
    with pytest.raises(RuntimeError, match="cannot send"):
        client.send_activation(WIRE, encode_tensor(ARRAY))


def test_idle_connection_news() -> None:
    client = ClientConnection()
    assert client.reusable
    assert client.next_event() is NEED_DATA
    client.receive_data(b"")
    assert client.next_event() == ConnectionClosed()
    assert not client.reusable
    # A server timing out an idle keep-alive connection: 408 and close.
    client = ClientConnection()
    client.receive_data(
        b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    )
    assert client.next_event() == ConnectionClosed()
    client = ClientConnection()
    client.receive_data(b"\x00garbage\r\n\r\n")
    assert client.next_event() == ConnectionClosed()


def test_sending_twice_without_a_response_is_refused() -> None:
    client = sent_activation()
    with pytest.raises(RuntimeError):
        client.send_request("GET", "/health")


def test_invalid_requests_are_refused() -> None:
    client = ClientConnection()
    with pytest.raises(ValueError, match="cannot send"):
        client.send_request("GET", "/x", [(b"X-Bad", b"a\r\nb")])
    with pytest.raises(ValueError):
        ClientConnection(token="")
    with pytest.raises(ValueError):
        ClientConnection(max_response_body=-1)


# ------------------------------------------------------------------ events


def test_client_events_validate_their_fields() -> None:
    with pytest.raises(ValueError):
        ActivationResponse(status=404, headers=WIRE, body=b"", tensor=None)
    with pytest.raises(TypeError):
        ActivationResponse(status=200, headers=None, body=b"", tensor=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ActivationResponse(status=200, headers=WIRE, body="x", tensor=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ActivationResponse(status=200, headers=WIRE, body=b"", tensor=[1])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ErrorResponse(status=200, error={}, raw=b"")
    with pytest.raises(TypeError):
        ErrorResponse(status=500, error=[], raw=b"")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ErrorResponse(status=500, error={}, raw="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ErrorResponse(status=500, error={}, raw=b"", retry_after=-1)
    with pytest.raises(ValueError):
        Response(status=500, headers=(), body=b"")
    with pytest.raises(TypeError):
        Response(status=200, headers=(), body=bytearray())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Response(status=True, headers=(), body=b"")  # type: ignore[arg-type]
    # An empty error dict still relays as something well-formed.
    relayed = ErrorResponse(status=500, error={}, raw=b"").to_error(hop="h")
    assert (relayed.code, relayed.message, relayed.hop) == ("downstream_bad_response", "", "h")
