"""The server role's h11 (meshnet_proto._h11_answering): the same answers as h11's."""

from __future__ import annotations

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_proto._h11_answering import AnsweringH11


def _lower_names(head: bytes) -> bytes:
    """A head with its header names lowercased (HTTP names have no case)."""
    status, *lines = head.split(b"\r\n")
    return b"\r\n".join([status, *(_lower_name(line) for line in lines)])


def _lower_name(line: bytes) -> bytes:
    name, colon, value = line.partition(b":")
    return name.lower() + colon + value if colon else line


def _exchange(
    connection: type[h11.Connection],
    request: bytes,
    status: int,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    trusted: bool,
) -> tuple[list[bytes], object, object]:
    conn = connection(h11.SERVER)
    conn.receive_data(request)
    for _ in range(4):  # request, its body, its end: bounded, as PAUSED repeats
        if conn.next_event() in (h11.NEED_DATA, h11.PAUSED):
            break
    response = h11.Response(status_code=status, headers=headers, reason=b"R", _parsed=trusted)
    sent = [_lower_names(b"".join(conn.send_with_data_passthrough(response) or []))]
    if body:
        pieces = conn.send_with_data_passthrough(h11.Data(data=body)) or []
        sent += [bytes(piece) for piece in pieces]
    sent += [bytes(piece) for piece in conn.send_with_data_passthrough(h11.EndOfMessage()) or []]
    return sent, conn.our_state, conn.their_state


_REQUESTS = st.sampled_from(
    [
        b"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
        b"HEAD / HTTP/1.1\r\nHost: a\r\n\r\n",
        b"POST /v2/forward HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nab",
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        b"GET / HTTP/1.0\r\n\r\n",
    ]
)
_EXTRA = st.lists(
    st.sampled_from(
        [
            (b"X-Meshnet-Shape", b"1,1,8"),
            (b"Content-Type", b"application/octet-stream"),
            (b"Connection", b"keep-alive"),
            (b"Connection", b"close"),
            (b"Transfer-Encoding", b"chunked"),
            (b"X-A", b"b"),
        ]
    ),
    max_size=4,
    unique=True,
)


@settings(max_examples=300, deadline=None)
@given(
    _REQUESTS,
    st.sampled_from([200, 204, 304, 404, 503]),
    _EXTRA,
    st.sampled_from([None, 0, 5]),
    st.booleans(),
)
def test_answers_are_h11s_own_bytes_and_states(
    request: bytes, status: int, extra: list[tuple[bytes, bytes]], length: int | None, trusted: bool
) -> None:
    """Whatever the request, status, framing and Connection header, the
    subclass sends what h11 sends (names compared without case) and ends in
    the same states: it only skips a rebuild that would change nothing."""
    if length is not None and (b"Transfer-Encoding", b"chunked") in extra:
        return  # h11 refuses both framings at once; not an answer we build
    headers = [*extra, *([(b"Content-Length", str(length).encode())] if length is not None else [])]
    body = b"x" * (length or 0) if status not in (204, 304) else b""
    if not body and length:
        headers = [pair for pair in headers if pair[0] != b"Content-Length"]
    outcomes = []
    for connection in (h11.Connection, AnsweringH11):
        try:
            outcomes.append(_exchange(connection, request, status, headers, body, trusted))
        except h11.LocalProtocolError as exc:
            outcomes.append(("refused", str(exc)))  # type: ignore[arg-type]
    assert outcomes[0] == outcomes[1]


def test_a_content_length_answer_keeps_its_names_and_skips_the_rebuild() -> None:
    """The case it is for: kept as built (h11 would lowercase the names), and
    a trusted head is not run through the header checks again."""
    conn = AnsweringH11(h11.SERVER)
    conn.receive_data(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n")
    assert isinstance(conn.next_event(), h11.Request)
    response = h11.Response(
        status_code=200,
        headers=[(b"X-Meshnet-Shape", b"1,2"), (b"Content-Length", b"0")],
        _parsed=True,
    )
    assert conn._clean_up_response_headers_for_sending(response) is response
    head = b"".join(conn.send_with_data_passthrough(response) or [])
    assert b"\r\nX-Meshnet-Shape: 1,2\r\n" in head


@pytest.mark.parametrize(
    "request_bytes",
    [b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n", b"GET / HTTP/1.0\r\n\r\n"],
)
def test_a_closing_answer_still_gets_h11s_connection_close(request_bytes: bytes) -> None:
    conn = AnsweringH11(h11.SERVER)
    conn.receive_data(request_bytes)
    assert isinstance(conn.next_event(), h11.Request)
    head = b"".join(
        conn.send_with_data_passthrough(
            h11.Response(status_code=200, headers=[(b"Content-Length", b"0")])
        )
        or []
    )
    assert b"\r\nconnection: close\r\n" in head.lower()
