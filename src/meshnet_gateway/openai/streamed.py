"""A streamed answer's server-sent events: each choice's role chunk, its
text as it comes (chunks naming their choice's ``index`` when ``n`` > 1),
each choice's last chunk, the usage when asked, then ``data: [DONE]``.

While nothing else is written — a long prompt's prefill, a queue, a forced
tool call whose text is held until its block closes — an SSE comment goes
out every ``KEEPALIVE_SECONDS``, so that a proxy or a client with a read
timeout does not take the quiet for a dead server (nginx's default is 60 s).

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

from .choices import first_failure
from .errors import OpenAIError, from_meshnet
from .formats import Format
from .logprobs import TokenLogprob
from .output import GenerationResult, OnText

__all__ = ["KEEPALIVE_SECONDS", "SSE_HEADERS", "SSE_HEARTBEAT", "OpenStreams", "stream_events"]

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
# An SSE comment: every client skips it. The server writes it to learn
# whether a client that half-closed its side is still there to read.
SSE_HEARTBEAT = b": still generating\n\n"
# The longest a stream stays quiet (vLLM's and llama.cpp's clients and the
# common proxies time out after 60 s or more).
KEEPALIVE_SECONDS = 15.0

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
    keepalive: float = KEEPALIVE_SECONDS,
) -> None:
    """The events of one streamed answer of ``choices`` choices."""
    writer = _Writer(send)
    try:
        async with anyio.create_task_group() as keeping:
            keeping.start_soon(writer.keep_alive, keepalive)
            try:
                await _events(writer, fmt, choices, include_usage, run, streams)
            finally:
                keeping.cancel_scope.cancel()
    except BaseExceptionGroup as failures:
        raise first_failure(failures) from None


class _Writer:
    """One stream's writes, one at a time, and when the last one went out."""

    def __init__(self, send: StreamSend) -> None:
        self.send = send
        self.lock = anyio.Lock()  # choices generate at once: one event written at a time
        self.last = anyio.current_time()

    async def write(self, data: bytes) -> None:
        async with self.lock:
            await self.send(data)
            self.last = anyio.current_time()

    async def keep_alive(self, interval: float) -> None:
        while True:
            await anyio.sleep(max(0.0, self.last + interval - anyio.current_time()))
            if anyio.current_time() - self.last >= interval:
                await self.write(SSE_HEARTBEAT)


async def _events(
    writer: _Writer,
    fmt: Format,
    choices: int,
    include_usage: bool,
    run: RunChoices,
    streams: OpenStreams,
) -> None:
    async def event(document: dict[str, Any]) -> None:
        await writer.write(b"data: " + json.dumps(document).encode() + b"\n\n")

    send = writer.write

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
