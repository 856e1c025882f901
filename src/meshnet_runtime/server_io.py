"""Bytes between a stream and a `ServerConnection`: reading until the next
event, writing an answer whole, draining before an early close, and what
the stream tells about its peer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import anyio
from anyio import TypedAttributeLookupError
from anyio.abc import ByteStream, SocketAttribute

from meshnet_proto import (
    NEED_DATA,
    ActivationHead,
    ActivationReceived,
    EndpointRequest,
    ServerConnection,
)

from .codec_pool import CodecPool
from .streams import BODY_READ_SIZE, DEAD_STREAM, READ_SIZE
from .transports import coalesce

__all__ = [
    "DRAIN_BYTES",
    "DRAIN_SECONDS",
    "OFFLOAD_READ_SIZE",
    "Closed",
    "drain",
    "event_path",
    "peer_host",
    "read_event",
    "write",
]

OFFLOAD_READ_SIZE = BODY_READ_SIZE
# After an early answer (body unread) the client may still be sending: read
# and discard briefly so it gets to read our answer instead of a reset.
DRAIN_SECONDS = 1.0
DRAIN_BYTES = 4 * 1024 * 1024


class Closed(Exception):
    """The connection is over (peer gone, write timed out)."""


def peer_host(stream: ByteStream) -> str | None:
    """The peer's host (see ``RequestContext.peer``); TLS streams pass it through."""
    try:
        address = stream.extra(SocketAttribute.remote_address)
    except TypedAttributeLookupError:
        return None
    if isinstance(address, tuple):
        return str(address[0])
    return "unix"


def event_path(event: object) -> str:
    if isinstance(event, EndpointRequest):
        return event.path
    if isinstance(event, (ActivationHead, ActivationReceived)):
        return "/forward"
    return "other"


async def read_event(
    conn: ServerConnection,
    stream: ByteStream,
    counter: list[int] | None = None,
    offload: CodecPool | None = None,
    read_size: int = READ_SIZE,
    on_body: Callable[[], None] | None = None,
) -> Any:
    """The next event, reading as needed; EOF is fed as ``b""``.

    With ``offload``, ``next_event`` runs in a worker thread: the core decodes
    (decompresses) the body inside the call that sees its last byte, and a
    large zstd body must not stall the event loop. Reads are larger then, to
    keep the thread hops few.

    ``on_body()`` is called once, when the core has taken a head and reads
    its body (an endpoint's request is one event: only this tells the
    driver that the head is done and the body timeout applies).
    """
    if offload is not None:
        read_size = max(read_size, OFFLOAD_READ_SIZE)
    while True:
        if offload is None:
            event = conn.next_event()
        else:
            event = await offload.run(offload.inline_bytes, conn.next_event)
        if event is not NEED_DATA:
            return event
        if on_body is not None and conn.reading_body:
            on_body()
            on_body = None
        try:
            data = await stream.receive(read_size)
        except DEAD_STREAM:
            data = b""
        if counter is not None:
            counter[0] += len(data)
        conn.receive_data(data)


async def write(stream: ByteStream, lock: anyio.Lock, parts: Sequence[Any], timeout: float) -> None:
    """Write ``parts`` in order; a half-written answer is never abandoned to a
    cancellation (it would corrupt the stream), only to the write timeout."""
    parts = coalesce(parts)
    async with lock:
        with anyio.move_on_after(timeout, shield=True) as scope:
            for part in parts:
                if len(part):
                    await stream.send(part)
        if scope.cancelled_caught:
            raise Closed("write timed out")


async def drain(stream: ByteStream) -> None:
    with anyio.move_on_after(DRAIN_SECONDS, shield=True):
        # TLS cannot half-close (NotImplementedError); a stream may be closed already.
        with contextlib.suppress(NotImplementedError, *DEAD_STREAM):
            await stream.send_eof()
        seen = 0
        try:
            while seen < DRAIN_BYTES:
                seen += len(await stream.receive(READ_SIZE))
        except DEAD_STREAM:
            pass
