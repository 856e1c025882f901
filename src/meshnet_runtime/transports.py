"""Byte-stream transports: TCP, TLS over TCP, Unix sockets, memory (wire-2 §8).

The core speaks to bytes, the drivers to ``anyio.abc.ByteStream``: everything
here ends in one of those, so the server loop and the downstream pool never
know which transport they run on.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import ByteStream, Listener, SocketAttribute
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from anyio.streams.stapled import StapledObjectStream

from .endpoints import Endpoint, format_url

__all__ = [
    "COALESCE_BYTES",
    "coalesce",
    "BoundListener",
    "client_ssl_context",
    "connect",
    "listen",
    "memory_stream_pair",
    "server_ssl_context",
]


# A message this small goes out in one send (head and body joined): one
# syscall and one segment instead of two, so the peer wakes and parses once.
# A decode step's 16 KiB answer spent a tenth of its node time on the second
# send (meshnet bench, section decode). Larger bodies are sent as they are:
# joining would copy them.
COALESCE_BYTES = 64 * 1024


def coalesce(parts: Sequence[Any]) -> Sequence[Any]:
    """``parts`` (a head and a body, say) as one joined piece when small."""
    if len(parts) > 1:
        total = 0
        for part in parts:  # a loop, not sum() over a generator: every answer comes here
            total += len(part)
        if total <= COALESCE_BYTES:
            return [b"".join(parts)]
    return parts


def server_ssl_context(cert: str, key: str) -> ssl.SSLContext:
    """A server context from PEM files (``--tls-cert``/``--tls-key``)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    # HTTP/1.1 only: advertise it so ALPN-speaking clients do not guess.
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def client_ssl_context(ca: str | None = None) -> ssl.SSLContext:
    """A verifying client context; ``ca`` (``--tls-ca``) replaces the system store."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


async def connect(endpoint: Endpoint, *, ssl_context: ssl.SSLContext | None = None) -> ByteStream:
    """Open a stream to ``endpoint``; raises ``OSError``/``ssl.SSLError`` on failure."""
    if endpoint.scheme == "unix":
        assert endpoint.path is not None
        return await anyio.connect_unix(endpoint.path)
    assert endpoint.host is not None and endpoint.port is not None
    if endpoint.tls:
        return await anyio.connect_tcp(
            endpoint.host,
            endpoint.port,
            tls=True,
            ssl_context=ssl_context or client_ssl_context(),
            # HTTP frames its own messages; a peer closing without
            # close_notify is not an attack on us (same choice as httpx).
            tls_standard_compatible=False,
        )
    return await anyio.connect_tcp(endpoint.host, endpoint.port)


@dataclass(slots=True)
class BoundListener:
    """A listening socket and the URL it is reachable at (the real port)."""

    listener: Listener[ByteStream]
    url: str
    uds_path: str | None = None

    async def aclose(self) -> None:
        await self.listener.aclose()
        if self.uds_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.uds_path)


async def listen(
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    uds: str | None = None,
    tls: bool = False,
) -> BoundListener:
    """Listen on ``uds`` or ``host:port`` (port 0 = a free one).

    TLS is not wrapped here: the server loop wraps each accepted stream so
    the handshake runs under its head timeout and inside the connection cap.
    """
    if uds is not None:
        # A stale socket file from a killed server would make bind fail; only
        # remove it when it really is a socket, never a regular file.
        try:
            if stat.S_ISSOCK(os.stat(uds).st_mode):
                os.unlink(uds)
        except FileNotFoundError:
            pass
        unix_listener = await anyio.create_unix_listener(uds)
        return BoundListener(unix_listener, format_url("unix", path=uds), uds_path=uds)
    tcp_listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    bound_port = tcp_listener.listeners[0].extra(SocketAttribute.local_port)
    scheme = "https" if tls else "http"
    return BoundListener(tcp_listener, format_url(scheme, host, bound_port))  # type: ignore[arg-type]


class _MemoryByteStream(ByteStream):
    """One side of an in-memory byte pipe (tests: no sockets at all)."""

    def __init__(self, stream: StapledObjectStream[bytes]) -> None:
        self._stream = stream

    async def receive(self, max_bytes: int = 65536) -> bytes:
        # Whole sends may exceed max_bytes; the callers only need "some bytes".
        return await self._stream.receive()

    async def send(self, item: bytes) -> None:
        await self._stream.send(bytes(item))

    async def send_eof(self) -> None:
        await self._stream.send_stream.aclose()

    async def aclose(self) -> None:
        await self._stream.aclose()


def memory_stream_pair(buffer: int = 64) -> tuple[ByteStream, ByteStream]:
    """Two connected in-memory ``ByteStream``s (a client end and a server end)."""
    a_send: MemoryObjectSendStream[bytes]
    b_recv: MemoryObjectReceiveStream[bytes]
    a_send, b_recv = anyio.create_memory_object_stream[bytes](buffer)
    b_send, a_recv = anyio.create_memory_object_stream[bytes](buffer)
    return (
        _MemoryByteStream(StapledObjectStream(a_send, a_recv)),
        _MemoryByteStream(StapledObjectStream(b_send, b_recv)),
    )
