"""Content-Length body bytes straight into our buffer, past h11's copies.

h11 copies every body byte three times on its way to us: ``receive_data``
appends it to its receive buffer, and its Content-Length reader slices the
same range out twice (``maybe_extract_at_most``). For a tensor body that is
most of a hop's CPU (``meshnet bench``, section hop: ~40 % of a node's
samples on a 64 MiB identity body). Our own copy into the preallocated body
buffer is the only one needed.

So while h11 is reading a Content-Length body *and holds no unread bytes*
(it last answered ``NEED_DATA``), the bytes that arrive next belong, up to
the body's remaining length, to that body and nothing else: the connection
copies them into its buffer itself and counts them off h11's remaining
length; h11 then sees ``EndOfMessage`` exactly where it would have, and
any bytes past the body (a pipelined next request) go to h11 as usual.
h11 still frames the message: we only ever take what its own counter says
is body, never more, so the framing (what request smuggling attacks) is
h11's throughout.

The counter is h11's private ``ContentLengthReader._remaining``: h11 has no
public way to be told "these bytes were consumed". `_h11_shim` owns that
touch; where the installed h11 fails its probe, nothing is pending and
every byte takes the ordinary path through h11.
"""

from __future__ import annotations

from collections.abc import Callable

import h11

from ._h11_shim import count_off, pending_body_bytes

__all__ = ["take_body_bytes"]


def take_body_bytes(
    conn: h11.Connection, data: bytes | bytearray | memoryview, sink: Callable[[memoryview], None]
) -> bytes | bytearray | memoryview:
    """Give ``sink`` the leading bytes of ``data`` that belong to the body h11
    is reading and count them off h11's reader; return what is left for h11
    (empty when the body took it all). Call only while h11 holds no unread
    bytes: otherwise those come first, and ``data`` is not the body's next."""
    take = min(pending_body_bytes(conn), len(data))
    if not take:
        return data
    view = memoryview(data)
    sink(view[:take])
    count_off(conn, take)
    return view[take:]
