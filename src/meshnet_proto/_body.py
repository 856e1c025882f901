"""Bodies in memory: the buffer a body is read into, held to its bound, and
the byte view of a body about to be sent.

Both connection roles use these; the bytes that skip h11 on their way into a
buffer are `_body_bypass`'s concern.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._errors import ErrorCode, ProtocolError
from ._limits import KiB

__all__ = ["Body", "BodyReader", "Output", "as_byte_buffer", "body_buffer"]

Body = bytes | bytearray | memoryview
Output = list[bytes | bytearray | memoryview]

_LAZY_BUFFER_BYTES = 256 * KiB


def body_buffer(size: int) -> bytearray | memoryview:
    """A writable buffer of ``size`` bytes that commits memory only as it is
    written.

    ``bytearray(size)`` zero-fills, so a head promising a 512 MiB tensor would
    commit 512 MiB before a byte of body arrives (and keep it for the body
    timeout). From `_LAZY_BUFFER_BYTES` on, the buffer is uninitialised memory
    from ``numpy.empty``: the allocator hands out untouched pages (committed
    when written) or reuses memory the process already holds, and never
    writes it first. An anonymous ``mmap`` commits as written too, but every
    page of a fresh mapping is a fault and a kernel zero-fill: filling 16 MiB
    took 16-19 ms against ~2 ms, on each side of every hop
    (meshnet bench, section hop). Growing a bytearray by appending commits as
    written as well, but its reallocations copy (up to twice the body held at
    once, and quadratic time when the allocator cannot grow in place).
    """
    if size < _LAZY_BUFFER_BYTES:
        return bytearray(size)
    return np.empty(size, dtype=np.uint8).data


@dataclass(slots=True)
class BodyReader:
    """One body being collected into one preallocated buffer (`body_buffer`);
    a chunked or until-close body of unknown size grows a bytearray.

    ``buffer=None``: made at the first piece, ``limit`` bytes — unless that
    piece is the whole body and is handed over (`take`): then it is kept as
    it is, without the buffer's zero-fill and the copy (section decode).
    """

    buffer: bytearray | memoryview | None
    limit: int  # bytes the body may have; over it is 413
    what: str = "request"  # named in the error: "request body", "response body"
    filled: int = 0
    whole: bytes | bytearray | None = None  # the body, when it was handed over whole

    def add(self, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` in after what came before."""
        end = self.filled + len(data)
        if end > self.limit:
            raise ProtocolError(
                f"{self.what} body over its bound of {self.limit} bytes",
                code=ErrorCode.BODY_TOO_LARGE,
            )
        if not data:
            return  # nothing to copy (and a body kept whole stays so)
        if self.buffer is None:  # (never with a whole body: it is at the limit)
            self.buffer = body_buffer(self.limit)
        # Only a bytearray grows past its buffer (to at most `limit`): slice
        # assignment extends it.
        self.buffer[self.filled : end] = data
        self.filled = end

    def take(self, data: bytes | bytearray) -> None:
        """``add`` a piece nobody else holds or writes to (an h11 ``Data``
        event's: h11 slices a new object out of its buffer for each). The
        whole body in one such piece (it came with its head: a decode
        step's) is kept as it is."""
        if self.buffer is None and not self.filled and len(data) == self.limit:
            self.whole = data
            self.filled = len(data)
            return
        self.add(data)

    def view(self) -> memoryview:
        if self.whole is not None:
            return memoryview(self.whole)
        if self.buffer is None:  # nothing came: an empty body
            return memoryview(b"")
        return memoryview(self.buffer)[: self.filled]


def as_byte_buffer(body: Body) -> Body:
    """``body`` itself when ``len()`` counts its bytes, else a byte view of
    it (a typed or multi-dimensional memoryview, e.g. over a numpy array).
    Never a copy."""
    if isinstance(body, (bytes, bytearray)):
        return body
    if isinstance(body, memoryview):
        if body.format == "B" and body.ndim == 1:
            return body
        if not body.c_contiguous:
            raise ValueError("a body memoryview must be C-contiguous")
        return body.cast("B")
    raise TypeError("body must be bytes, bytearray or memoryview")
