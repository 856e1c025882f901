"""BodyReader (meshnet_proto._body): one body collected, or kept whole."""

from __future__ import annotations

import pytest

from meshnet_proto import ProtocolError
from meshnet_proto._body import BodyReader


def test_a_whole_body_handed_over_is_kept_as_it_is() -> None:
    piece = bytearray(b"abcd")  # as h11 slices it out of its buffer
    body = BodyReader(None, 4)
    body.take(piece)
    assert body.buffer is None and body.filled == 4  # no buffer made, nothing copied
    assert body.view().obj is piece and bytes(body.view()) == b"abcd"
    body.add(b"")  # an empty piece changes nothing
    assert body.view().obj is piece
    with pytest.raises(ProtocolError) as caught:
        body.take(b"e")  # past the limit, as ever
    assert caught.value.code == "body_too_large"


def test_a_body_in_pieces_is_copied_into_one_buffer() -> None:
    first = bytearray(b"ab")
    body = BodyReader(None, 4)
    body.take(first)
    body.take(b"cd")
    first[:] = b"zz"  # the buffer holds a copy
    assert body.buffer is not None and bytes(body.view()) == b"abcd"


def test_only_a_handed_over_piece_is_kept_whole() -> None:
    # add() is for bytes someone else may still hold (the bypass's view of
    # the driver's data): always copied.
    data = bytearray(b"abcd")
    body = BodyReader(None, 4)
    body.add(memoryview(data))
    data[:] = b"zzzz"
    assert body.buffer is not None and bytes(body.view()) == b"abcd"


def test_an_empty_body_views_as_empty() -> None:
    body = BodyReader(None, 0)
    body.add(b"")
    assert body.buffer is None and bytes(body.view()) == b""
