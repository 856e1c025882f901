"""Both connection roles' phase tables (meshnet_proto._state).

Per role: a trigger the table does not list raises, and the table is total
over what the code does — a battery of exchanges through the public API
moves through every pair the table lists, and through no other (a pair the
code takes that is not in the table would raise; one the table lists that
no exchange takes would be dead).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest

import meshnet_proto._state as state
from meshnet_proto import (
    NEED_DATA,
    PAUSED,
    ActivationHead,
    ClientConnection,
    ConnectionClosed,
    DownstreamError,
    EndpointRequest,
    ProtocolError,
    ProtocolErrorReceived,
    ServerConnection,
    WireHeaders,
    encode_tensor,
)
from meshnet_proto._state import (
    ClientPhase,
    ClientTrigger,
    ServerPhase,
    ServerTrigger,
    client_next,
    server_next,
)

SESSION = "5b1e0c2a-9f3d-4c1e-8a7b-0123456789ab"
ERROR = ProtocolError("no", code="malformed_request")


class _Recording(Mapping[object, object]):
    """A transition table that remembers which pairs were looked up."""

    def __init__(self, table: Mapping[object, object]) -> None:
        self.table = table
        self.used: set[object] = set()

    def __getitem__(self, key: object) -> object:
        self.used.add(key)
        return self.table[key]

    def __iter__(self) -> Iterator[object]:
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)


def _activation(*, content_length: int | None = None, cut: int = 0) -> bytes:
    array = np.ones((1, 2, 3), dtype=np.float32)
    wire = WireHeaders.for_array(array, session=SESSION, chunk_index=0, chunk_total=1)
    body = bytes(encode_tensor(array))
    head = b"POST /forward HTTP/1.1\r\nHost: n\r\n"
    head += b"".join(name + b": " + value + b"\r\n" for name, value in wire.to_pairs())
    length = len(body) if content_length is None else content_length
    return head + b"Content-Length: %d\r\n\r\n" % length + body[: len(body) - cut]


def _events(conn: ServerConnection, data: bytes | None) -> list[object]:
    """Feed ``data`` (None: nothing), then the events up to the next head,
    pause, need for data or end."""
    if data is not None:
        conn.receive_data(data)
    out: list[object] = []
    while (event := conn.next_event()) is not NEED_DATA and event is not PAUSED:
        out.append(event)
        if isinstance(event, (ActivationHead, ConnectionClosed, ProtocolErrorReceived)):
            break
    return out


# ------------------------------------------------------------------ server


def _server_keep_alive_activation(conn: ServerConnection) -> None:
    assert isinstance(_events(conn, _activation())[0], ActivationHead)
    _events(conn, None)
    conn.send_response(204)
    assert not conn.should_close


def _server_streams(close: bool) -> Callable[[ServerConnection], None]:
    def run(conn: ServerConnection) -> None:
        extra = b"Connection: close\r\n" if close else b""
        assert isinstance(_events(conn, b"GET /info HTTP/1.1\r\nHost: n\r\n" + extra + b"\r\n")[0],
                          EndpointRequest)  # fmt: skip
        conn.send_stream_start(200)
        assert not conn.can_send_error
        conn.send_stream_end()
        assert conn.should_close is close

    return run


def _server_answers_close(conn: ServerConnection) -> None:
    _events(conn, b"GET /info HTTP/1.1\r\nHost: n\r\nConnection: close\r\n\r\n")
    conn.send_response(200)
    assert conn.should_close


def _server_bad_head(conn: ServerConnection) -> None:
    assert isinstance(_events(conn, b"BREW /pot HTTP/1.1\r\n\r\n")[0], ProtocolErrorReceived)
    assert conn.can_send_error
    conn.send_error(ERROR)


def _server_peer_closes(conn: ServerConnection) -> None:
    assert isinstance(_events(conn, b"")[0], ConnectionClosed)


def _server_times_out_mid_head(conn: ServerConnection) -> None:
    assert _events(conn, b"GET /inf") == []
    conn.send_error(ERROR)


def _server_rejects_head(conn: ServerConnection) -> None:
    head = _activation().partition(b"\r\n\r\n")[0] + b"\r\n\r\n"
    assert isinstance(_events(conn, head)[0], ActivationHead)
    conn.send_error(ERROR)


def _server_times_out_mid_body(conn: ServerConnection) -> None:
    _events(conn, _activation(cut=5))
    _events(conn, None)
    assert conn.reading_body
    conn.send_error(ERROR)


def _server_short_identity_body(conn: ServerConnection) -> None:
    _events(conn, _activation(content_length=4))
    events = _events(conn, None)
    assert isinstance(events[-1], ProtocolErrorReceived)


def _server_endpoint_times_out(conn: ServerConnection) -> None:
    _events(conn, b"DELETE /sessions/x HTTP/1.1\r\nHost: n\r\nContent-Length: 9\r\n\r\nab")
    assert conn.reading_body
    conn.send_error(ERROR)


def _server_endpoint_cut(conn: ServerConnection) -> None:
    _events(conn, b"DELETE /sessions/x HTTP/1.1\r\nHost: n\r\nContent-Length: 9\r\n\r\nab")
    assert isinstance(_events(conn, b"")[0], ProtocolErrorReceived)


SERVER_EXCHANGES = [
    _server_keep_alive_activation,
    _server_streams(close=False),
    _server_streams(close=True),
    _server_answers_close,
    _server_bad_head,
    _server_peer_closes,
    _server_times_out_mid_head,
    _server_rejects_head,
    _server_times_out_mid_body,
    _server_short_identity_body,
    _server_endpoint_times_out,
    _server_endpoint_cut,
]


def test_can_send_error_follows_the_answer() -> None:
    conn = ServerConnection()
    assert conn.can_send_error
    _events(conn, b"GET /info HTTP/1.1\r\nHost: n\r\n\r\n")
    assert conn.can_send_error
    conn.send_stream_start(200)
    # The status went out: an error can no longer be answered, only closed.
    assert not conn.can_send_error
    with pytest.raises(RuntimeError, match="cannot send this now"):
        conn.send_error(ERROR)
    closed = ServerConnection()
    _events(closed, b"")
    assert not closed.can_send_error
    with pytest.raises(RuntimeError, match="closed"):
        closed.send_error(ERROR)


# ------------------------------------------------------------------ client

_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def _client_sent(conn: ClientConnection) -> ClientConnection:
    conn.send_request("GET", "/info")
    return conn


def _client_keep_alive(conn: ClientConnection) -> None:
    _client_sent(conn).receive_data(_OK)
    assert conn.next_event().status == 200  # type: ignore[union-attr]
    assert conn.reusable


def _client_close(conn: ClientConnection) -> None:
    _client_sent(conn).receive_data(_OK.replace(b"OK\r\n", b"OK\r\nConnection: close\r\n"))
    conn.next_event()
    assert not conn.reusable


def _client_garbage(conn: ClientConnection) -> None:
    _client_sent(conn).receive_data(b"SPLAT\r\n\r\n")
    with pytest.raises(DownstreamError):
        conn.next_event()


def _client_cut_body(conn: ClientConnection) -> None:
    _client_sent(conn).receive_data(_OK[:-1])
    assert conn.next_event() is NEED_DATA
    conn.receive_data(b"")
    with pytest.raises(DownstreamError, match="closed the connection"):
        conn.next_event()


def _client_idle_close(conn: ClientConnection) -> None:
    conn.receive_data(b"")
    assert isinstance(conn.next_event(), ConnectionClosed)


def _client_send_refused(conn: ClientConnection) -> None:
    with pytest.raises(ValueError, match="cannot send"):
        conn.send_request("GET", "/info", [(b"X-Bad", b"a\r\nb")])
    assert not conn.reusable


CLIENT_EXCHANGES = [
    _client_keep_alive,
    _client_close,
    _client_garbage,
    _client_cut_body,
    _client_idle_close,
    _client_send_refused,
]


# ------------------------------------------------------------------ both roles

# (the table's name in _state, a new connection, the exchanges that drive it)
ROLES = {
    "server": ("SERVER_TRANSITIONS", ServerConnection, SERVER_EXCHANGES),
    "client": ("CLIENT_TRANSITIONS", ClientConnection, CLIENT_EXCHANGES),
}


@pytest.mark.parametrize("role", ROLES)
def test_the_table_is_exactly_what_the_connection_does(
    role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every transition the exchanges take is in the role's table, and every
    entry of the table is taken by some exchange (none is dead)."""
    table, connection, exchanges = ROLES[role]
    recording = _Recording(getattr(state, table))
    monkeypatch.setattr(state, table, recording)
    for exchange in exchanges:
        exchange(connection())
    assert recording.used == set(recording.table)


ILLEGAL: list[tuple[Callable[[Any, Any], Any], Any, Any, str]] = [
    (server_next, ServerPhase.CLOSED, ServerTrigger.READ_BODY, "'read body' in phase 'closed'"),
    (server_next, ServerPhase.IDLE, ServerTrigger.REQUEST_COMPLETE, "ServerConnection"),
    (client_next, ClientPhase.ERROR, ClientTrigger.REQUEST_SENT, "'request sent' in phase 'error'"),
    (client_next, ClientPhase.CLOSED, ClientTrigger.RESPONSE_HEAD, "ClientConnection"),
]


@pytest.mark.parametrize(("step", "phase", "trigger", "message"), ILLEGAL)
def test_an_illegal_trigger_raises(
    step: Callable[[Any, Any], Any], phase: Any, trigger: Any, message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        step(phase, trigger)
