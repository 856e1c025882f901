"""The reading half both connection roles share (meshnet_proto._reading)."""

from __future__ import annotations

import h11
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_proto._reading import header_pairs

_NAMES = st.sampled_from(
    [
        b"X-Meshnet-Session",
        b"X-Meshnet-Shape",
        b"x-meshnet-dtype",
        b"CONTENT-LENGTH",
        b"Accept",
        b"X-A",
    ]
)
_VALUES = st.binary(min_size=0, max_size=12).map(
    lambda raw: bytes(b % 94 + 33 for b in raw)  # visible ASCII, no separators in play
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_NAMES, _VALUES), max_size=8), st.booleans())
def test_header_pairs_are_what_iterating_h11s_headers_gives(
    fields: list[tuple[bytes, bytes]], response: bool
) -> None:
    """Read off h11's own list (a private one: h11 is pinned below 0.17), the
    pairs must be exactly ``tuple(headers)``: lowercased names, values as
    sent, in order, repeats kept."""
    kept = [(name, value) for name, value in fields if name.lower() != b"content-length"]
    head = b"".join(name + b": " + value + b"\r\n" for name, value in kept)
    if response:
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method="GET", target="/", headers=[("Host", "t")]))
        conn.send(h11.EndOfMessage())
        conn.receive_data(b"HTTP/1.1 200 OK\r\n" + head + b"Content-Length: 0\r\n\r\n")
    else:
        conn = h11.Connection(h11.SERVER)
        conn.receive_data(b"GET / HTTP/1.1\r\nHost: t\r\n" + head + b"\r\n")
    event = conn.next_event()
    assert isinstance(event, (h11.Request, h11.Response))
    assert header_pairs(event.headers) == tuple(event.headers)
    assert all(name == name.lower() for name, _ in header_pairs(event.headers))
