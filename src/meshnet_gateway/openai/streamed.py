"""A streamed answer's server-sent events: each choice's role chunk, its
text as it comes (chunks naming their choice's ``index`` when ``n`` > 1),
each choice's last chunk, the usage when asked, then ``data: [DONE]``.

The 200 head is out before the generation runs, so a chain failure travels
as an error event; a server shutting down ends every open stream by its
drain deadline with a ``shutting_down`` event rather than cutting it
mid-answer (``OpenStreams``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from meshnet_proto import MeshnetError
from meshnet_runtime.http_server import StreamSend

from .errors import OpenAIError, from_meshnet
from .formats import Format
from .logprobs import TokenLogprob
from .output import GenerationResult, OnText

__all__ = ["SSE_HEADERS", "SSE_HEARTBEAT", "OpenStreams", "stream_events"]

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
# An SSE comment: every client skips it. The server writes it to learn
# whether a client that half-closed its side is still there to read.
SSE_HEARTBEAT = b": still generating\n\n"

# Runs every choice, given each choice's text callback by its index.
RunChoices = Callable[[Callable[[int], OnText]], Awaitable[list[GenerationResult]]]

# The last event of a stream the server's shutdown ended (then data: [DONE]).
_SHUTTING_DOWN = OpenAIError(
    "the server is shutting down: this completion ended before it finished; "
    "retry it when the server is back (or on another replica)",
    status=503,
    type="server_error",
    code="shutting_down",
)


class OpenStreams:
    """The generation scopes of the open streams, and when they must end
    (None until the server drains)."""

    def __init__(self) -> None:
        self.scopes: set[anyio.CancelScope] = set()
        self.end: float | None = None

    def end_by(self, deadline: float) -> int:
        """Every open stream (and any started from now on) ends by
        ``deadline`` (anyio's clock); how many are open."""
        self.end = deadline
        for scope in self.scopes:
            scope.deadline = min(scope.deadline, deadline)
        return len(self.scopes)


async def stream_events(
    send: StreamSend,
    fmt: Format,
    choices: int,
    include_usage: bool,
    run: RunChoices,
    streams: OpenStreams,
) -> None:
    """The events of one streamed answer of ``choices`` choices."""
    sending = anyio.Lock()  # choices generate at once: one event written at a time

    async def event(document: dict[str, Any]) -> None:
        async with sending:
            await send(b"data: " + json.dumps(document).encode() + b"\n\n")

    def on_text(index: int) -> OnText:
        async def text(piece: str, logprobs: list[TokenLogprob] | None) -> None:
            for document in fmt.chunks(piece, logprobs, index):
                await event(document)

        return text

    for index in range(choices):
        first = fmt.first_chunk(index)
        if first is not None:
            await event(first)  # may be cancelled: the client left
    try:
        with anyio.CancelScope(deadline=streams.end or math.inf) as scope:
            streams.scopes.add(scope)
            try:
                results = await run(on_text)
            finally:
                streams.scopes.discard(scope)
    except MeshnetError as exc:
        await event(from_meshnet(exc).body())
        return
    if scope.cancelled_caught:  # the server is shutting down
        await event(_SHUTTING_DOWN.body())
        await send(b"data: [DONE]\n\n")
        return
    for index, result in enumerate(results):
        for document in fmt.last_chunks(result, index):
            await event(document)
    if include_usage:
        await event(fmt.usage_chunk(results))
    await send(b"data: [DONE]\n\n")
