"""Every touch of h11's private state, in this one module.

h11 has no public way to do what the paths below do; everything else in
the core uses h11's public API only (tests/repo/test_h11_private.py holds
it to that). Each path is probed once, at import, against the h11 that is
installed — by what it does, not by its version number: the probe runs the
private path on a small message and compares it with the public one. A
probe that fails (a future h11 renamed or changed what it relies on) leaves
the public path in its place: slower, never wrong.

* **The body counter** (`pending_body_bytes`, `count_off`): the
  Content-Length reader's ``Connection._reader._remaining``. h11 has no
  public "these body bytes were consumed elsewhere"; with it, a tensor body
  skips h11's receive buffer and its two slices (`_body_bypass`). Without
  it, every body byte goes through h11.

Checked against h11 0.14.0, 0.15.0 and 0.16.0 (pyproject allows
``>=0.14,<0.17``); ``.ci/h11-versions`` runs tests/proto and the runtime's
HTTP tests on the oldest and the newest allowed minor. What each path was
worth, measured on a whole token and on a prefill chunk, and why the others
went back to the public API: docs/performance.md, "h11 through its public
API".
"""

from __future__ import annotations

from typing import Any

import h11

__all__ = ["count_off", "pending_body_bytes"]

# A request whose body is cut short: the probe watches the counter count down.
_PROBE_REQUEST = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nab"


def _reader_of(conn: h11.Connection) -> Any:
    """The reader of the message h11 is reading (None between messages)."""
    return getattr(conn, "_reader", None)


def probe_body_counter() -> type[Any] | None:
    """The type of h11's Content-Length reader when its ``_remaining`` is
    the count the bypass needs (the body bytes still to come, an int that
    h11 reads again before each event), else None."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(_PROBE_REQUEST)
    conn.next_event()  # the request
    reader = _reader_of(conn)
    if type(getattr(reader, "_remaining", None)) is not int:
        return None
    conn.next_event()  # b"ab": three bytes to go
    if _reader_of(conn) is not reader or reader._remaining != 3:
        return None
    reader._remaining -= 3  # as if consumed outside h11
    if type(conn.next_event()) is not h11.EndOfMessage:
        return None
    return type(reader)


# None where the installed h11 fails the probe: then nothing bypasses it.
_CONTENT_LENGTH_READER = probe_body_counter()


def pending_body_bytes(conn: h11.Connection) -> int:
    """Body bytes h11 still expects of the Content-Length body it is reading
    (0 when it is not reading one, or the probe found no counter to trust)."""
    reader = _reader_of(conn)
    if _CONTENT_LENGTH_READER is None or type(reader) is not _CONTENT_LENGTH_READER:
        return 0
    return max(reader._remaining, 0)  # type: ignore[no-any-return]  # the probe saw an int


def count_off(conn: h11.Connection, nbytes: int) -> None:
    """Tell h11's reader that ``nbytes`` of its body were consumed outside it
    (``nbytes`` <= :func:`pending_body_bytes`, which found the reader first)."""
    _reader_of(conn)._remaining -= nbytes
