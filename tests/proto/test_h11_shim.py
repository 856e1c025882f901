"""The one module that touches h11's private state (meshnet_proto._h11_shim):
its probe accepts the installed h11, refuses an h11 that keeps its count
some other way, and with the probe refused the connections still read every
body right (through h11's public path)."""

from __future__ import annotations

from typing import Any, cast

import h11
import numpy as np
import pytest

from meshnet_proto import (
    NEED_DATA,
    ActivationHead,
    ActivationReceived,
    ClientConnection,
    ServerConnection,
    WireHeaders,
    _h11_shim,
    encode_tensor,
)

SESSION = "5b1e0c2a-9f3d-4c1e-8a7b-0123456789ab"
TENSOR = np.arange(3 * 64, dtype=np.float32).reshape(1, 3, 64)


def test_the_installed_h11_passes_the_probe() -> None:
    """CI runs this on the oldest and the newest h11 pyproject allows
    (.ci/h11-versions): on each, the fast path is on."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n\r\n")
    assert isinstance(conn.next_event(), h11.Request)
    assert _h11_shim.probe_body_counter() is _h11_shim._CONTENT_LENGTH_READER
    assert _h11_shim.pending_body_bytes(conn) == 4


class _CountsElsewhere(h11.Connection):
    """An h11 whose reader has no ``_remaining``."""

    def next_event(self) -> Any:
        event = super().next_event()
        self._reader = None  # h11 sets it to None between messages
        return event


class _NeverCountsDown(h11.Connection):
    """An h11 whose ``_remaining`` is not the bytes still to come."""

    def next_event(self) -> Any:
        event = super().next_event()
        if type(event) is h11.Data:
            cast(Any, self._reader)._remaining = 5
        return event


class _ReadsPastTheCount(h11.Connection):
    """An h11 that does not end the body where ``_remaining`` says."""

    def next_event(self) -> Any:
        event = super().next_event()
        return h11.NEED_DATA if type(event) is h11.EndOfMessage else event


@pytest.mark.parametrize("connection", [_CountsElsewhere, _NeverCountsDown, _ReadsPastTheCount])
def test_an_h11_that_counts_otherwise_fails_the_probe(
    monkeypatch: pytest.MonkeyPatch, connection: type[h11.Connection]
) -> None:
    monkeypatch.setattr(h11, "Connection", connection)
    assert _h11_shim.probe_body_counter() is None


def _request() -> bytes:
    wire = WireHeaders.for_array(TENSOR, session=SESSION, chunk_index=0, chunk_total=1,
                                 position=0)  # fmt: skip
    pieces = ClientConnection().send_activation(wire, encode_tensor(TENSOR))
    return b"".join(bytes(piece) for piece in pieces)


def test_without_the_counter_every_body_byte_goes_through_h11(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fallback: nothing is pending, so the bytes after the head (which
    the counter would have taken) are h11's to read, and the body is the same."""
    monkeypatch.setattr(_h11_shim, "_CONTENT_LENGTH_READER", None)
    data = _request()
    head_end = data.index(b"\r\n\r\n") + 4
    conn = ServerConnection()
    conn.receive_data(data[:head_end])
    assert isinstance(conn.next_event(), ActivationHead)
    assert conn.next_event() is NEED_DATA
    assert _h11_shim.pending_body_bytes(conn._h11) == 0
    conn.receive_data(data[head_end:])
    received = conn.next_event()
    assert isinstance(received, ActivationReceived)
    assert received.tensor.tobytes() == TENSOR.tobytes()
