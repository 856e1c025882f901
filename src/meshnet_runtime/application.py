"""What an application and the serving loop exchange: the `Application`
protocol the loop calls, the `RequestContext` it passes, and the replies an
application returns (`ActivationReply`, `Reply`, `StreamReply`).

Each handler returns what to send; an error is *raised* as a
``MeshnetError`` and answered with ``send_error``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from meshnet_proto import ActivationHead, ActivationReceived, EndpointRequest, WireHeaders

__all__ = [
    "ActivationReply",
    "Application",
    "Reply",
    "RequestContext",
    "StreamReply",
    "StreamSend",
]


@dataclass(frozen=True, slots=True)
class ActivationReply:
    """A ``200`` wire-2 answer: ``send_activation(headers, body)``."""

    headers: WireHeaders
    body: bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class Reply:
    """Any other answer: ``send_response(status, headers, body)``."""

    status: int
    headers: Sequence[tuple[bytes | str, bytes | str]] = ()
    body: bytes = b""

    @classmethod
    def json(cls, status: int, document: Any) -> Reply:
        body = json.dumps(document, separators=(",", ":")).encode()
        return cls(status, [(b"content-type", b"application/json")], body)


StreamSend = Callable[[bytes], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class StreamReply:
    """An answer whose body is produced while it is sent (server-sent events).

    The driver writes the head, then awaits ``produce(send)``; each
    ``await send(piece)`` writes one piece. When the client goes away
    mid-stream (a reset on its side, or a write that fails), ``produce`` is
    *cancelled*. A client's end of stream is only a half-close: while
    nothing else is written, ``heartbeat`` (when set) is, every
    ``HALF_CLOSE_PROBE`` seconds, to find out. ``produce`` must free what it holds in a
    ``finally`` (shielded where that awaits). An exception out of
    ``produce`` after the head went out can no longer become an error
    answer: it is logged and the connection closed.
    """

    status: int
    headers: Sequence[tuple[bytes | str, bytes | str]]
    produce: Callable[[StreamSend], Awaitable[None]]
    # A piece the client ignores (an SSE comment): written while a client
    # that half-closed is checked for still being there (see client_watch).
    heartbeat: bytes = b""


@dataclass(slots=True)
class RequestContext:
    """What the driver knows about a request beyond its event."""

    started: float  # anyio clock when the head (or whole request) was parsed
    path: str
    # The peer's host (TCP: its address without the port; "unix" for every
    # Unix-socket peer; None for a stream without one): the client of the
    # per-client session quota (wire-2 §3.9).
    peer: str | None = None
    # Run when the request's cycle ends, however it ends (a body that never
    # came included): what an application set aside at the head and did not
    # hand on (the bytes a KV import's head holds, wire-2 §3.11).
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    # The loop's clock (what anyio.current_time() reads), looked up once per
    # connection: the cheap way to read it on a request's path.
    clock: Callable[[], float] = anyio.current_time
    # The tenant the request's API key names (docs/security.md, tenants), or
    # None: a request on the chain's token, or a server without API keys.
    tenant: str | None = None
    # Set at the head by an application that holds something for the body
    # (a KV import's bytes, wire-2 §3.11): the body's timeout instead of the
    # server's, when shorter.
    body_timeout: float | None = None

    @property
    def client(self) -> str | None:
        """Whom quotas, fair queues and the prefix cache count this request
        for: its tenant, else its peer's address."""
        return self.tenant if self.tenant is not None else self.peer


class Application(Protocol):
    async def handle_activation_head(self, event: ActivationHead, ctx: RequestContext) -> None:
        """Header-only checks; raise ``MeshnetError`` to reject before the body."""

    async def handle_activation(
        self, event: ActivationReceived, ctx: RequestContext
    ) -> ActivationReply | Reply: ...

    async def handle_endpoint(
        self, event: EndpointRequest, ctx: RequestContext
    ) -> ActivationReply | Reply | StreamReply: ...

    def cancel_on_disconnect(self, event: EndpointRequest | ActivationReceived) -> bool:
        """True: cancel the handler of this complete request when its client
        leaves (nobody would read the answer); the connection closes."""
        ...
