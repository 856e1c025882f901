"""What the server loop and the downstream client both know about a byte stream.

One place for the read sizes, for the exceptions that mean "the peer is
gone" (not our bug), and for closing a stream that may already be dead.
"""

from __future__ import annotations

import logging
import ssl

import anyio
from anyio.abc import ByteStream

__all__ = ["BODY_READ_SIZE", "DEAD_STREAM", "READ_SIZE", "aclose_quietly", "body_read_size"]

log = logging.getLogger("meshnet.streams")

# A head, an endpoint request, a small answer: one read.
READ_SIZE = 65536
# A tensor body (a request's or an answer's) larger than one read is read up
# to this much at a time: each receive costs a loop round and an h11 event
# (~40 us), so 64 KiB reads of a 16 MiB body spent more on rounds than on
# bytes (meshnet bench, section hop). The read is transient: the body buffer
# still commits memory only as bytes arrive, and only after the head passed
# every check.
BODY_READ_SIZE = 1024 * 1024

# A peer that went away, reset, or failed its TLS: an event of the network.
DEAD_STREAM: tuple[type[BaseException], ...] = (
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    OSError,
    ssl.SSLError,
)


def body_read_size(nbytes: int) -> int:
    """Reads sized to a body of ``nbytes``: at least one read, at most 1 MiB."""
    return min(BODY_READ_SIZE, max(READ_SIZE, nbytes))


async def aclose_quietly(stream: ByteStream, *, timeout: float = 1.0) -> None:
    """Close ``stream``, bounded in time. A dead peer is expected and
    silent; anything else is a bug somewhere, and is logged (not raised:
    closing runs in cleanup paths that must finish)."""
    try:
        with anyio.move_on_after(timeout):
            await stream.aclose()
    except DEAD_STREAM:
        pass
    except Exception:
        log.warning("closing a stream failed", exc_info=True)
