"""Watching for a client that leaves while its request is being answered,
so that work nobody will read (a handler, a streamed answer's producer) is
cancelled instead of running to its end."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
from anyio.abc import ByteStream

from meshnet_proto import ServerConnection

from .server_io import Closed
from .streams import DEAD_STREAM, READ_SIZE

__all__ = ["HALF_CLOSE_PROBE", "Send", "until_client_leaves", "watching_client"]

_T = TypeVar("_T")

# After a client half-closed during a watched request, how often a probe
# checks it is still there (see until_client_leaves): a client that left
# is found out about this long after it left (the first probe meets the
# reset, the next one fails), while a few bytes a second to one still
# reading cost nothing.
HALF_CLOSE_PROBE = 0.25

# Writes answer pieces in order; raises `Closed` when the client is gone.
Send = Callable[[Sequence[Any]], Awaitable[None]]


async def until_client_leaves(
    stream: ByteStream,
    conn: ServerConnection,
    send: Send,
    on_leave: Callable[[], None],
    probe: Callable[[], Sequence[Any]],
) -> None:
    """Call ``on_leave`` when the client is gone (a reset, a failed write).

    Only while a complete request is being answered: the client has
    nothing to send then but a pipelined next request, whose bytes are
    kept for later (and the watch ends). Cancelling this loses no byte.

    An end of stream is *not* leaving: a client may half-close after
    its request and still read the answer (RFC 9112 §9.6). Only a write
    tells that client from one whose socket is closed, so from then on
    ``probe()`` (bytes the client ignores) goes out at once and every
    ``HALF_CLOSE_PROBE`` seconds: a closed socket answers the first with
    a reset, and the next write fails. No probe, no more watching: the
    answer's own writes will fail.
    """
    try:
        data = await stream.receive(READ_SIZE)
    except anyio.EndOfStream:
        data = b""
    except DEAD_STREAM:
        on_leave()
        return
    if data:
        conn.receive_data(data)  # parsed after this answer
        return
    while True:
        parts = probe()
        if not any(len(part) for part in parts):
            return
        try:
            await send(parts)
        except Closed:
            on_leave()
            return
        await anyio.sleep(HALF_CLOSE_PROBE)


async def watching_client(
    stream: ByteStream,
    conn: ServerConnection,
    send: Send,
    work: Callable[[Callable[[], None]], Awaitable[_T]],
    probe: Callable[[], Sequence[Any]],
) -> tuple[_T | None, bool]:
    """``work(leave)`` while the connection is watched for the client leaving:
    ``(its result, False)``, or ``(None, True)`` once the client left (or
    ``work`` called ``leave``) and ``work`` was cancelled — nobody would
    read what it produces."""
    result: _T | None = None
    client_gone = False
    async with anyio.create_task_group() as tg:

        def leave() -> None:
            nonlocal client_gone
            client_gone = True
            tg.cancel_scope.cancel()

        tg.start_soon(until_client_leaves, stream, conn, send, leave, probe)
        result = await work(leave)
        # Stop watching before answering: a streamed answer watches on its own.
        tg.cancel_scope.cancel()
    return (None, True) if client_gone else (result, False)
