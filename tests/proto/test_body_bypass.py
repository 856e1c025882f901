"""Tensor body bytes that skip h11's buffer (``_body_bypass``) change nothing.

Whichever way the bytes are cut — a body arriving after its head, split
anywhere, with the next pipelined request in the same piece as the body's
last bytes — the events are those of the same bytes fed whole (where h11
sees every byte), and h11's framing holds: the next request starts exactly
where the Content-Length body ends.
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_proto import (
    NEED_DATA,
    PAUSED,
    ActivationHead,
    ActivationReceived,
    ActivationResponse,
    ClientConnection,
    ConnectionClosed,
    ServerConnection,
    WireHeaders,
    encode_tensor,
)
from meshnet_proto._h11_shim import pending_body_bytes

SESSION = "5b1e0c2a-9f3d-4c1e-8a7b-0123456789ab"
FIRST = np.arange(2 * 64, dtype=np.float32).reshape(1, 2, 64) / 3
SECOND = -np.arange(3 * 64, dtype=np.float32).reshape(1, 3, 64)


def request(array: np.ndarray, position: int) -> bytes:
    client = ClientConnection()
    wire = WireHeaders.for_array(array, session=SESSION, chunk_index=0, chunk_total=1,
                                 position=position)  # fmt: skip
    return b"".join(bytes(part) for part in client.send_activation(wire, encode_tensor(array)))


def serve(pieces: list[bytes]) -> list[tuple[str, bytes]]:
    """Feed ``pieces``, answering each activation; (kind, tensor bytes) of each event."""
    conn = ServerConnection()
    seen: list[tuple[str, bytes]] = []
    for piece in pieces:
        conn.receive_data(piece)
        while (event := conn.next_event()) is not NEED_DATA:
            if event is PAUSED:
                break
            if isinstance(event, ActivationHead):
                seen.append(("head", str(event.headers.shape).encode()))
            else:
                assert isinstance(event, ActivationReceived), event
                seen.append(("body", event.tensor.tobytes()))
                conn.send_activation(event.headers, encode_tensor(event.tensor))
    return seen


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=2000), min_size=1, max_size=8))
def test_server_events_do_not_depend_on_how_the_bytes_are_cut(cuts: list[int]) -> None:
    data = request(FIRST, 0) + request(SECOND, 2)
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    pieces = [data[a:b] for a, b in itertools.pairwise(points) if b > a]
    expected = [("head", b"(1, 2, 64)"), ("body", FIRST.tobytes()),
                ("head", b"(1, 3, 64)"), ("body", SECOND.tobytes())]  # fmt: skip
    assert serve([data]) == expected
    assert serve(pieces) == expected


def test_body_and_next_request_in_one_piece_after_the_head() -> None:
    """The bypass takes exactly the body's remaining bytes; h11 gets the rest."""
    first, second = request(FIRST, 0), request(SECOND, 2)
    head_end = first.index(b"\r\n\r\n") + 4
    conn = ServerConnection()
    conn.receive_data(first[:head_end])
    assert isinstance(conn.next_event(), ActivationHead)
    assert conn.next_event() is NEED_DATA  # h11 holds nothing: the bypass may take bytes
    conn.receive_data(first[head_end : head_end + 10])
    assert conn.next_event() is NEED_DATA
    conn.receive_data(first[head_end + 10 :] + second)
    received = conn.next_event()
    assert isinstance(received, ActivationReceived)
    assert received.tensor.tobytes() == FIRST.tobytes()
    conn.send_activation(received.headers, encode_tensor(received.tensor))
    assert isinstance(conn.next_event(), ActivationHead)
    following = conn.next_event()
    assert isinstance(following, ActivationReceived)
    assert following.tensor.tobytes() == SECOND.tobytes()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=1000), min_size=1, max_size=6))
def test_client_response_does_not_depend_on_how_the_bytes_are_cut(cuts: list[int]) -> None:
    server = ServerConnection()
    client = ClientConnection()
    wire = WireHeaders.for_array(FIRST, session=SESSION, chunk_index=0, chunk_total=1, position=0)
    for part in client.send_activation(wire, encode_tensor(FIRST)):
        server.receive_data(bytes(part))
    assert isinstance(server.next_event(), ActivationHead)
    received = server.next_event()
    assert isinstance(received, ActivationReceived)
    answer = server.send_activation(received.headers, encode_tensor(received.tensor))
    data = b"".join(bytes(part) for part in answer)
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    for a, b in itertools.pairwise(points):
        client.receive_data(data[a:b])
        event = client.next_event()
        if b < len(data):
            assert event is NEED_DATA
    assert isinstance(event, ActivationResponse)
    assert event.tensor is not None and event.tensor.tobytes() == FIRST.tobytes()


def test_nothing_pending_outside_a_content_length_body() -> None:
    import h11

    assert pending_body_bytes(h11.Connection(h11.SERVER)) == 0


def test_client_bytes_past_the_response_body_go_to_h11() -> None:
    """A response's last body bytes and whatever follows them in one piece:
    the body takes exactly its remaining length, h11 gets the rest (here
    bytes no server may send between exchanges, so the connection ends)."""
    server = ServerConnection()
    client = ClientConnection()
    wire = WireHeaders.for_array(FIRST, session=SESSION, chunk_index=0, chunk_total=1, position=0)
    for part in client.send_activation(wire, encode_tensor(FIRST)):
        server.receive_data(bytes(part))
    assert isinstance(server.next_event(), ActivationHead)
    received = server.next_event()
    assert isinstance(received, ActivationReceived)
    answer = server.send_activation(received.headers, encode_tensor(received.tensor))
    data = b"".join(bytes(part) for part in answer)
    head_end = data.index(b"\r\n\r\n") + 4
    client.receive_data(data[:head_end])
    assert client.next_event() is NEED_DATA  # h11 drained: the body may bypass it
    client.receive_data(data[head_end:] + b"garbage\r\n\r\n")
    response = client.next_event()
    assert isinstance(response, ActivationResponse)
    assert response.tensor is not None and response.tensor.tobytes() == FIRST.tobytes()
    assert isinstance(client.next_event(), ConnectionClosed)
