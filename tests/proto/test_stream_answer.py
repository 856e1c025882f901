"""A streamed answer from the core (``send_stream_start/data/end``: the
gateway's server-sent events), through the public API and without sockets:
its framing, its phases, and what it refuses."""

from __future__ import annotations

import pytest

from meshnet_proto import EndpointRequest, ServerConnection


def _asked(request: bytes = b"GET /info HTTP/1.1\r\nHost: n\r\n\r\n") -> ServerConnection:
    conn = ServerConnection()
    conn.receive_data(request)
    event = conn.next_event()
    assert isinstance(event, EndpointRequest)
    return conn


def test_a_streamed_answer_is_chunked_and_the_connection_stays_open() -> None:
    conn = _asked()
    head = conn.send_stream_start(200, [(b"Content-Type", b"text/event-stream")])
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"transfer-encoding: chunked" in head.lower() and b"content-length" not in head.lower()
    assert b"".join(conn.send_stream_data(b"data: 1\n\n")) == b"9\r\ndata: 1\n\n\r\n"
    assert conn.send_stream_data(b"") == []  # an empty piece would end the chunked body
    assert b"".join(conn.send_stream_end()) == b"0\r\n\r\n"
    # Keep-alive: the next request on the same connection is read.
    conn.receive_data(b"GET /health HTTP/1.1\r\nHost: n\r\n\r\n")
    event = conn.next_event()
    assert isinstance(event, EndpointRequest) and event.path == "/health"


def test_a_streamed_answer_to_http_1_0_is_framed_by_the_close() -> None:
    conn = _asked(b"GET /info HTTP/1.0\r\n\r\n")
    head = conn.send_stream_start(200)
    assert b"chunked" not in head.lower()
    assert b"".join(conn.send_stream_data(b"data: 1\n\n")) == b"data: 1\n\n"
    assert b"".join(conn.send_stream_end()) == b""


@pytest.mark.parametrize("status", [204, 304, 199, 600, "200"])
def test_a_stream_needs_a_status_with_a_body(status: object) -> None:
    conn = _asked()
    with pytest.raises(ValueError, match="a streamed answer needs a status with a body"):
        conn.send_stream_start(status)  # type: ignore[arg-type]
    assert conn.send_stream_start(200)  # nothing was sent: the answer can still begin


def test_stream_calls_out_of_phase_are_refused() -> None:
    idle = ServerConnection()
    with pytest.raises(RuntimeError, match="no complete request to answer"):
        idle.send_stream_start(200)
    conn = _asked()
    for call in (lambda: conn.send_stream_data(b"x"), conn.send_stream_end):
        with pytest.raises(RuntimeError, match="no streamed answer in progress"):
            call()
    conn.send_stream_start(200)
    conn.send_stream_end()
    with pytest.raises(RuntimeError, match="no streamed answer in progress"):
        conn.send_stream_data(b"late")
