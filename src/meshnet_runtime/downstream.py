"""A pooled keep-alive client to one downstream URL (a node's ``--next``,
the gateway's ``--entry``).

Every failure becomes a ``DownstreamError`` whose ``hop`` is the URL exactly
as configured (wire-2 §4): connect refused, reset or EOF → 502
``downstream_unreachable``; a response the core cannot read → 502
``downstream_bad_response``; the deadline → 504 ``downstream_timeout``.
A downstream's own error answer is *returned* (``ErrorResponse``), not
raised: relaying it is the caller's decision (``ErrorResponse.to_error``).
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import anyio
from anyio.abc import ByteStream

from meshnet_proto import (
    NEED_DATA,
    ActivationResponse,
    ClientConnection,
    ConnectionClosed,
    DownstreamError,
    ErrorCode,
    ErrorResponse,
    Limits,
    MeshnetError,
    Response,
    WireHeaders,
)

from .deadlines import DEFAULT_MARGIN, Deadline
from .endpoints import Endpoint, parse_endpoint
from .link import LinkEstimate
from .metrics import ServerMetrics
from .streams import DEAD_STREAM, aclose_quietly, body_read_size
from .transports import coalesce, connect

__all__ = ["Downstream", "DownstreamPool", "key_headers"]

log = logging.getLogger("meshnet.downstream")

# A pooled connection idle longer than this is closed, not reused. Servers
# close idle keep-alive connections at their head timeout (10 s by default):
# reusing one past that fails a request that may not be retried safely (a
# chunk without session and position), so the client lets go first, as
# httpx does with its keep-alive expiry.
KEEPALIVE_EXPIRY = 5.0


# Connections for control requests beside the data ones (see DownstreamPool).
CONTROL_CONNECTIONS = 4


class _Stale(Exception):
    """A pooled connection died before a single response byte: retryable."""


def key_headers(key: str | None) -> list[tuple[bytes, bytes]]:
    """The ``X-Meshnet-Session-Key`` header of a request on a keyed session
    (a ``DELETE /sessions/{id}`` passed down: wire-2 §3.9), or none."""
    return [] if key is None else [(b"X-Meshnet-Session-Key", key.encode("ascii"))]


Body = bytes | bytearray | memoryview


class Downstream(Protocol):
    """The hop below a server (a node's ``--next``, the gateway's ``--entry``):
    one node (``DownstreamPool``) or several serving the same stage
    (``replicas.ReplicaSet``). Servers hold either through this protocol and
    never ask which it is: what only a replica set does (failover state,
    probes, replay history) is a trivial method of ``DownstreamPool``.
    """

    @property
    def url(self) -> str:
        """The hop as configured (one URL, or the replicas' joined by commas)."""
        ...

    # How fast answers arrive from below (for --encoding auto).
    link: LinkEstimate
    # Told of every change of membership or state below (the gateway's chain
    # re-check); a single node never changes, so never calls it.
    on_change: Callable[[], None] | None

    async def forward(
        self, headers: WireHeaders, body: Body, deadline: Deadline, path: str = "/forward"
    ) -> ActivationResponse | ErrorResponse:
        """POST one activation (``path``: ``/forward?replay=1`` for a replay)."""
        ...

    async def request(
        self,
        method: str,
        target: str,
        deadline: Deadline,
        headers: Sequence[tuple[bytes, bytes]] = (),
        body: bytes = b"",
    ) -> Response | ErrorResponse:
        """Any other request (``GET /health``, ``DELETE /sessions/…``)."""
        ...

    async def deep_health(self, deadline: Deadline) -> dict[str, Any]:
        """What a deep health document says of the hop below (wire-2 §6.2):
        ``downstream`` (its answer) and, for a single node, ``next`` (its URL)."""
        ...

    @property
    def version(self) -> int:
        """Changes whenever the hop's replicas change (a cache of deep health is keyed by it)."""
        ...

    def describe(self) -> dict[str, Any] | None:
        """The replicas' state for ``/info`` (None: a single node)."""
        ...

    def forget(self, session: str) -> None:
        """The session ended here: drop what is kept for it (history, stickiness)."""
        ...

    def record_replayed(self, session: str, headers: WireHeaders, body: Body) -> None:
        """A replay rebuilt this node: keep what it would have sent, as if sent."""
        ...

    async def maintain(self) -> None:
        """The hop's upkeep task (health probes, DNS); returns at once when there is none."""
        ...

    @property
    def idle_connections(self) -> int:
        """Connections kept open for reuse."""
        ...

    async def aclose(self) -> None: ...


class DownstreamPool:
    """Up to ``max_connections`` keep-alive connections to one downstream.

    ``forward`` and ``request`` wait for a free connection (bounded by the
    deadline), so a burst upstream never opens more than the cap downstream.
    Control requests (``request``: ``DELETE /sessions/…``, ``GET /health``)
    have ``CONTROL_CONNECTIONS`` slots of their own: the DELETE that frees a
    session's KV cache must not queue behind the very activations that fill
    every data slot (issue 13: a disconnect storm's DELETEs timed out there
    and left their caches to the TTL).
    """

    def __init__(
        self,
        endpoint: Endpoint | str,
        *,
        limits: Limits | None = None,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = 16,
        margin: float = DEFAULT_MARGIN,
        metrics: ServerMetrics | None = None,
        connection_factory: Callable[[Endpoint], Any] | None = None,
        keepalive_expiry: float = KEEPALIVE_EXPIRY,
    ) -> None:
        self.endpoint = parse_endpoint(endpoint) if isinstance(endpoint, str) else endpoint
        self.limits = limits or Limits()
        self.token = token
        self.ssl_context = ssl_context
        self.margin = margin
        self.metrics = metrics
        # Tests inject memory streams here; default: the real transports.
        self._open = connection_factory or self._connect
        self._slots = anyio.Semaphore(max_connections)
        self._control_slots = anyio.Semaphore(CONTROL_CONNECTIONS)
        self.keepalive_expiry = keepalive_expiry
        # Oldest first; each with the loop time it went idle.
        self._idle: list[tuple[ByteStream, ClientConnection, float]] = []
        self._closed = False
        # How fast answers arrive from this downstream (for --encoding auto).
        self.link = LinkEstimate()
        self.on_change: Callable[[], None] | None = None  # one node: nothing changes

    @property
    def url(self) -> str:
        return self.endpoint.url

    async def _connect(self, endpoint: Endpoint) -> ByteStream:
        return await connect(endpoint, ssl_context=self.ssl_context)

    def _error(self, message: str, code: ErrorCode, status: int | None = None) -> DownstreamError:
        return DownstreamError(f"{self.url}: {message}", code=code, status=status, hop=self.url)

    # ---------------------------------------------------------------- API

    async def forward(
        self,
        headers: WireHeaders,
        body: bytes | bytearray | memoryview,
        deadline: Deadline,
        path: str = "/forward",
    ) -> ActivationResponse | ErrorResponse:
        """POST one activation; ``X-Meshnet-Deadline-Ms`` is set when written.

        ``path`` is ``/forward?replay=1`` for a replay to a new replica
        (docs/failover.md).

        Retried once on a stale pooled connection only when the chunk carries
        session and position: wire-2 §3 makes such a retransmission a replay.
        """

        def build(conn: ClientConnection) -> list[Any]:
            sent = headers.replace(deadline_ms=deadline.header_ms(self.margin))
            return conn.send_activation(sent, body, path)

        retry_safe = headers.session is not None and headers.position is not None
        event = await self._exchange(build, deadline, retry_safe, len(body))
        if not isinstance(event, (ActivationResponse, ErrorResponse)):
            raise self._error(
                f"answered an activation with status {event.status}",
                ErrorCode.DOWNSTREAM_BAD_RESPONSE,
            )
        return event

    async def request(
        self,
        method: str,
        target: str,
        deadline: Deadline,
        headers: Sequence[tuple[bytes, bytes]] = (),
        body: bytes = b"",
    ) -> Response | ErrorResponse:
        """Any other request (``GET /health``, ``DELETE /sessions/…``)."""

        def build(conn: ClientConnection) -> list[Any]:
            return conn.send_request(method, target, list(headers), body)

        retry_safe = method in ("GET", "HEAD", "DELETE")
        event = await self._exchange(build, deadline, retry_safe, 0, self._control_slots)
        if isinstance(event, ActivationResponse):
            raise self._error(
                "answered a request with an activation", ErrorCode.DOWNSTREAM_BAD_RESPONSE
            )
        return event

    async def fetch_kv(
        self, session: str, deadline: Deadline, headers: Sequence[tuple[bytes, bytes]] = ()
    ) -> ActivationResponse | ErrorResponse:
        """``GET /kv/{session}`` (wire-2 §3.11): the session's KV message, its
        body bounded as an activation's, left encoded (it is relayed as is)."""
        return await self.fetch_activation(f"/kv/{session}", deadline, headers)

    async def fetch_activation(
        self, target: str, deadline: Deadline, headers: Sequence[tuple[bytes, bytes]] = ()
    ) -> ActivationResponse | ErrorResponse:
        """A ``GET`` answered with a tensor (``/kv/{id}``, ``/drawn/{id}``:
        wire-2 §3.11, §3.14), its body bounded as an activation's, left encoded."""

        def build(conn: ClientConnection) -> list[Any]:
            return conn.send_request("GET", target, list(headers), expects_activation=True)

        event = await self._exchange(build, deadline, True, 0, self._control_slots)
        if not isinstance(event, ActivationResponse | ErrorResponse):
            raise self._error(
                f"answered GET {target} without a tensor", ErrorCode.DOWNSTREAM_BAD_RESPONSE
            )
        return event

    @property
    def idle_connections(self) -> int:
        """Connections kept open for reuse (a fresh request takes one)."""
        return len(self._idle)

    async def deep_health(self, deadline: Deadline) -> dict[str, Any]:
        """The next node's own deep health, as the ``downstream`` of ours.

        A 401 (our token is not the next hop's) is a chain problem, not an
        outage: it is reported as that node's ``cannot_serve``."""
        response = await self.request("GET", "/health?deep=1", deadline)
        if isinstance(response, ErrorResponse):
            if response.status != 401:
                raise response.to_error(hop=self.url)
            below: Any = {"status": "cannot_serve", "error": response.error}
        else:
            try:
                below = json.loads(response.body)
            except ValueError:
                raise self._error(
                    "/health is not JSON", ErrorCode.DOWNSTREAM_BAD_RESPONSE
                ) from None
        return {"next": self.url, "downstream": below}

    # The replica-only parts of ``Downstream``: one node has none of that state.

    @property
    def version(self) -> int:
        return 0

    def describe(self) -> dict[str, Any] | None:
        return None

    def forget(self, session: str) -> None:
        """No history, no stickiness to drop."""

    def record_replayed(self, session: str, headers: WireHeaders, body: Body) -> None:
        """Nothing is kept for a failover: there is no other node to move to."""

    async def maintain(self) -> None:
        """No probes, no names to resolve."""

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for stream, _, _ in idle:
            await aclose_quietly(stream)

    # ---------------------------------------------------------- internals

    async def _exchange(
        self,
        build: Callable[[ClientConnection], list[Any]],
        deadline: Deadline,
        retry_safe: bool,
        body_nbytes: int,
        slots: anyio.Semaphore | None = None,
    ) -> ActivationResponse | ErrorResponse | Response:
        deadline.check()
        try:
            with anyio.fail_after(max(deadline.remaining(), 0)):
                async with slots or self._slots:
                    for attempt in (1, 2):
                        # The retry opens a new connection: a server closes
                        # idle connections at its head timeout, so the stale
                        # one's idle siblings are likely stale too.
                        pooled = attempt == 1 and await self._has_fresh_idle()
                        try:
                            return await self._once(build, body_nbytes, pooled)
                        except _Stale as exc:
                            if attempt == 2 or not retry_safe:
                                raise self._error(
                                    "connection dropped", ErrorCode.DOWNSTREAM_UNREACHABLE
                                ) from exc
                            log.debug("stale pooled connection to %s; retrying once", self.url)
        except TimeoutError:
            raise self._error(
                "no answer before the deadline", ErrorCode.DOWNSTREAM_TIMEOUT
            ) from None
        raise AssertionError("unreachable")

    async def _has_fresh_idle(self) -> bool:
        """Close the pooled connections idle past the expiry; any left?"""
        expired_before = anyio.current_time() - self.keepalive_expiry
        while self._idle and self._idle[0][2] < expired_before:
            stream, _, _ = self._idle.pop(0)
            with anyio.CancelScope(shield=True):
                await aclose_quietly(stream)
        return bool(self._idle)

    async def _connection(self, pooled: bool) -> tuple[ByteStream, ClientConnection]:
        """An idle pooled connection, or a new one to the endpoint."""
        if pooled:
            stream, conn, _ = self._idle.pop()
            return stream, conn
        try:
            stream = await self._open(self.endpoint)
        except DEAD_STREAM as exc:
            raise self._error(f"cannot connect ({exc})", ErrorCode.DOWNSTREAM_UNREACHABLE) from None
        conn = ClientConnection(
            limits=self.limits,
            host=self.endpoint.authority,
            token=self.token,
            hop=self.url,
            decode=False,
        )
        return stream, conn

    async def _once(
        self, build: Callable[[ClientConnection], list[Any]], body_nbytes: int, pooled: bool
    ) -> ActivationResponse | ErrorResponse | Response:
        stream, conn = await self._connection(pooled)
        keep = False
        read_size = body_read_size(body_nbytes)  # an answer is about as large as its request
        try:
            received = 0
            first_read_at = 0.0  # bytes after the first read waited for the link
            after_first = 0
            try:
                for part in coalesce(build(conn)):
                    if len(part):
                        await stream.send(part)
                if self.metrics and body_nbytes:
                    self.metrics.bytes_out.labels("downstream").inc(body_nbytes)
                while True:
                    try:
                        event = conn.next_event()
                    except DownstreamError as exc:
                        # The core names the code (unreachable when the
                        # stream ended, bad_response for garbage) and the hop.
                        if exc.code == "downstream_unreachable" and pooled and not received:
                            raise _Stale from exc
                        raise
                    except MeshnetError as exc:  # defensive: any other core error
                        raise self._error(
                            f"bad response: {exc.message}", ErrorCode.DOWNSTREAM_BAD_RESPONSE
                        ) from None
                    if event is NEED_DATA:
                        try:
                            data = await stream.receive(read_size)
                        except anyio.EndOfStream:
                            data = b""
                        if received:
                            after_first += len(data)
                        elif data:
                            first_read_at = time.perf_counter()
                        received += len(data)
                        conn.receive_data(data)
                        continue
                    break
            except DEAD_STREAM as exc:
                if pooled and not received:
                    raise _Stale from exc
                raise self._error(
                    f"connection lost ({exc!r})", ErrorCode.DOWNSTREAM_UNREACHABLE
                ) from None
            if isinstance(event, ConnectionClosed):
                if pooled and not received:
                    raise _Stale
                raise self._error(
                    "closed the connection mid-response", ErrorCode.DOWNSTREAM_UNREACHABLE
                )
            if not isinstance(event, (ActivationResponse, ErrorResponse, Response)):
                raise self._error(
                    f"unexpected event {type(event).__name__}", ErrorCode.DOWNSTREAM_BAD_RESPONSE
                )
            if isinstance(event, ActivationResponse):
                self.link.observe(received, after_first, time.perf_counter() - first_read_at)
                if self.metrics:
                    self.metrics.bytes_in.labels("downstream").inc(len(event.body))
            if conn.reusable and not self._closed:
                conn.start_next_cycle()
                keep = True
            return event
        finally:
            if keep:
                self._idle.append((stream, conn, anyio.current_time()))
            else:
                with anyio.CancelScope(shield=True):
                    await aclose_quietly(stream)
