"""A small HTTP server for the runtime's tests: an echo application that can
hold a request in flight or fail on purpose, raw requests, and a server on
port 0 run by ``serve`` (its watchdog and drain included)."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import numpy as np
from anyio.abc import ByteStream

from meshnet_proto import (
    ActivationHead,
    ActivationReceived,
    EndpointRequest,
    SequencingError,
    ServerConnection,
)
from meshnet_runtime.http_server import (
    ActivationReply,
    HttpServer,
    Reply,
    RequestContext,
    ServerSettings,
)
from meshnet_runtime.metrics import ServerMetrics
from meshnet_runtime.transports import listen

__all__ = [
    "BUGGY_SHAPE",
    "REJECTED",
    "SID",
    "EchoApp",
    "activation",
    "at_eof",
    "running",
    "scripted_peer",
]

SID = "5b1e0c4e-8d8a-4c55-9d6e-1f2a3b4c5d6e"
REJECTED = "00000000-0000-4000-8000-000000000000"
BUGGY_SHAPE = (1, 13)


class EchoApp:
    def __init__(self) -> None:
        self.hold = False
        self.entered = anyio.Event()
        self.release = anyio.Event()

    async def handle_activation_head(self, event: ActivationHead, ctx: RequestContext) -> None:
        if event.headers.session == REJECTED:
            raise SequencingError("rejected before the body", code="session_unknown")

    async def handle_activation(
        self, event: ActivationReceived, ctx: RequestContext
    ) -> ActivationReply:
        if event.headers.shape == BUGGY_SHAPE:
            raise RuntimeError("a deliberate bug")
        if self.hold:
            self.entered.set()
            await self.release.wait()
        return ActivationReply(event.headers, event.tensor.tobytes())

    async def handle_endpoint(self, event: EndpointRequest, ctx: RequestContext) -> Reply:
        if event.path == "/info":
            raise KeyError("another deliberate bug")
        return Reply.json(200, {"status": "ok", "path": event.path})

    def cancel_on_disconnect(self, event: EndpointRequest | ActivationReceived) -> bool:
        return False


def activation(shape: tuple[int, ...] = (1, 4), session: str = SID, body: bytes | None = None,
               length: int | None = None, extra: bytes = b"") -> bytes:  # fmt: skip
    n = int(np.prod(shape)) * 4
    body = bytes(range(256)) * (n // 256) + bytes(n % 256) if body is None else body
    head = (
        f"POST /forward HTTP/1.1\r\nHost: t\r\nContent-Type: application/octet-stream\r\n"
        f"X-Meshnet-Shape: {','.join(map(str, shape))}\r\nX-Meshnet-Dtype: float32\r\n"
        f"X-Meshnet-Session: {session}\r\nX-Meshnet-Chunk-Index: 0\r\n"
        f"X-Meshnet-Chunk-Total: 1\r\nContent-Length: {len(body) if length is None else length}"
        f"\r\n"
    ).encode()
    return head + extra + b"\r\n" + body


async def at_eof(stream: ByteStream) -> bool:
    """True when the peer closed (bounded: a live connection fails the test)."""
    with anyio.fail_after(60):
        try:
            while await stream.receive():
                pass
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            return True
    return True


@asynccontextmanager
async def running(
    app: EchoApp | None = None,
    *,
    uds: str | None = None,
    tls: ssl.SSLContext | None = None,
    **settings: float,
) -> AsyncIterator[tuple[HttpServer, str]]:
    app = app or EchoApp()
    server = HttpServer(
        app,
        lambda: ServerConnection(),
        settings=ServerSettings(**{"head_timeout": 5.0, "shutdown_timeout": 5.0, **settings}),
        metrics=ServerMetrics("test"),
        ssl_context=tls,
    )
    bound = await listen(host="127.0.0.1", port=0, uds=uds, tls=tls is not None)
    async with anyio.create_task_group() as tg:
        url = await tg.start(server.serve, bound)
        try:
            yield server, url
        finally:
            server.request_shutdown()


@asynccontextmanager
async def scripted_peer(
    handle: Callable[[anyio.abc.SocketStream], Awaitable[None]],
) -> AsyncIterator[str]:
    """A loopback listener on port 0 whose connections ``handle`` serves by
    hand (a scripted or hostile peer); yields its URL, stops with the block."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            tg.cancel_scope.cancel()
