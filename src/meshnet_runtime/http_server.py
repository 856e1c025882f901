"""The serving loop: read, feed the ``ServerConnection``, act, write.

Modelled on hypercorn's trio worker and h11's trio example: per connection,
``receive(64 KiB)`` → ``receive_data`` → ``next_event`` → the application →
``send_*`` → ``stream.send``. Everything the wire means is decided by
``meshnet_proto``; this module only owns what needs a clock or a socket:
timeouts (408), the connection cap (503), the drain before an early close,
keep-alive, and graceful shutdown.

The application is an object with three coroutines (see :class:`Application`).
Each returns what to send; an error is *raised* as a ``MeshnetError`` and
answered with ``send_error``. Any other exception is our bug: it is logged,
answered 500 ``internal_error`` when the connection still can, and never
takes down the server or other connections.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio
import anyio.lowlevel
from anyio import TypedAttributeLookupError
from anyio.abc import ByteStream, SocketAttribute, TaskStatus
from anyio.streams.tls import TLSStream

from meshnet_proto import (
    NEED_DATA,
    ActivationHead,
    ActivationReceived,
    CapacityError,
    ConnectionClosed,
    EndpointRequest,
    MeshnetError,
    ProtocolError,
    ProtocolErrorReceived,
    ServerConnection,
    WireHeaders,
)
from meshnet_proto.lowlevel import ByteBudget, body_bound, request_cost

from .codec_pool import CodecPool
from .deadlines import Deadline, deadline_exceeded
from .metrics import ServerMetrics
from .streams import BODY_READ_SIZE, DEAD_STREAM, READ_SIZE, aclose_quietly, body_read_size
from .transports import BoundListener, coalesce

__all__ = [
    "ActivationReply",
    "Application",
    "HttpServer",
    "Reply",
    "RequestContext",
    "ServerSettings",
    "StreamReply",
]

_T = TypeVar("_T")
log = logging.getLogger("meshnet.server")

OFFLOAD_READ_SIZE = BODY_READ_SIZE
# After a client half-closed during a watched request, how often a probe
# checks it is still there (see _until_client_leaves): a client that left
# is found out about this long after it left (the first probe meets the
# reset, the next one fails), while a few bytes a second to one still
# reading cost nothing.
HALF_CLOSE_PROBE = 0.25
# After an early answer (body unread) the client may still be sending: read
# and discard briefly so it gets to read our answer instead of a reset.
DRAIN_SECONDS = 1.0
DRAIN_BYTES = 4 * 1024 * 1024


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
        import json

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
    # that half-closed is checked for still being there (see _Connection).
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


class Application(Protocol):
    async def handle_activation_head(self, event: ActivationHead, ctx: RequestContext) -> None:
        """Header-only checks; raise ``MeshnetError`` to reject before the body."""

    async def handle_activation(
        self, event: ActivationReceived, ctx: RequestContext
    ) -> ActivationReply | Reply: ...

    async def handle_endpoint(
        self, event: EndpointRequest, ctx: RequestContext
    ) -> ActivationReply | Reply | StreamReply: ...

    # Optional: ``cancel_on_disconnect(event) -> bool`` (an EndpointRequest
    # or an ActivationReceived): cancel the handler when the client leaves.


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    head_timeout: float = 10.0  # wire-2 §4: 408 when the head is slower
    body_timeout: float = 60.0  # the whole body; the server's --timeout
    write_timeout: float = 60.0  # one answer to a peer that stopped reading
    max_connections: int = 256
    shutdown_timeout: float = 30.0  # in-flight requests get this long
    retry_after: int = 1  # seconds, on 503 too_many_connections / shutting_down


class _Closed(Exception):
    """The connection is over (peer gone, write timed out)."""


class HttpServer:
    """Serves one application on any number of listeners and streams."""

    def __init__(
        self,
        app: Application,
        make_connection: Callable[[], ServerConnection],
        *,
        settings: ServerSettings = ServerSettings(),
        metrics: ServerMetrics | None = None,
        ssl_context: ssl.SSLContext | None = None,
        codecs: CodecPool | None = None,
        budget: ByteBudget | None = None,
        cost: Callable[[WireHeaders], int] = request_cost,
    ) -> None:
        self.app = app
        self.codecs = codecs
        # Tensor bytes held for requests in flight (wire-2 §3: waiting chunks
        # count against the memory limits); None = unbounded (tests, embedding).
        self.budget = budget
        self.cost = cost  # what one request holds, from its head alone
        if metrics is not None and budget is not None:
            metrics.inflight_bytes.set_function(lambda: budget.in_use)
        self.make_connection = make_connection
        self.settings = settings
        self.metrics = metrics
        self.ssl_context = ssl_context
        self.url: str | None = None
        self.draining = False
        self._shutdown = anyio.Event()
        self._connections: set[_Connection] = set()
        self._rejecting = 0
        self._all_closed = anyio.Event()

    # ------------------------------------------------------------- lifecycle

    def request_shutdown(self) -> None:
        """Begin a graceful shutdown (safe to call more than once)."""
        self._shutdown.set()

    async def serve(
        self,
        bound: BoundListener,
        *,
        task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept until :meth:`request_shutdown`, then drain and return.

        Shutdown: idle keep-alive connections close; requests already in
        flight get ``shutdown_timeout`` to finish. Until they have, the
        listener stays open and every new request — on a new connection or an
        open one — is answered 503 ``shutting_down`` with ``Retry-After``, so
        a sender learns to back off instead of meeting a refused connection
        it cannot tell from a crash. Then the listener closes; whatever is
        left is cancelled.
        """
        self.url = bound.url
        async with anyio.create_task_group() as connections:
            accepting = anyio.CancelScope()
            accepted = anyio.Event()
            connections.start_soon(self._accept, bound, connections, accepting, accepted)
            task_status.started(bound.url)
            await self._shutdown.wait()
            self.draining = True
            for connection in list(self._connections):
                connection.close_if_idle()
            with anyio.move_on_after(self.settings.shutdown_timeout) as drain:
                # Only requests in flight hold the drain open: a stream of new
                # connections (each rejected at once) must not prolong it.
                while self._connections:
                    self._all_closed = anyio.Event()
                    await self._all_closed.wait()
            accepting.cancel()
            with anyio.CancelScope(shield=True):
                await accepted.wait()  # closing a listener under accept() is an error
                await bound.aclose()
            with anyio.move_on_after(max(drain.deadline - anyio.current_time(), 0)):
                while self._rejecting:
                    self._all_closed = anyio.Event()
                    await self._all_closed.wait()
            connections.cancel_scope.cancel()

    async def _accept(
        self,
        bound: BoundListener,
        connections: anyio.abc.TaskGroup,
        scope: anyio.CancelScope,
        done: anyio.Event,
    ) -> None:
        try:
            with scope:
                await bound.listener.serve(self.serve_stream, task_group=connections)
        finally:
            done.set()

    # ------------------------------------------------------------ per stream

    async def serve_stream(self, stream: ByteStream) -> None:
        """Serve one accepted (or in-memory) stream to its end; never raises."""
        try:
            if self.ssl_context is not None:
                with anyio.move_on_after(self.settings.head_timeout):
                    stream = await TLSStream.wrap(
                        stream, server_side=True, ssl_context=self.ssl_context,
                        standard_compatible=False,
                    )  # fmt: skip
                if not isinstance(stream, TLSStream):
                    return
            if self.draining:
                await self._reject(stream, _shutting_down(self.settings.retry_after))
            elif len(self._connections) >= self.settings.max_connections:
                await self._reject(stream, _too_many(self.settings.retry_after))
            else:
                connection = _Connection(self, stream)
                self._connections.add(connection)
                if self.metrics:
                    self.metrics.connections.inc()
                try:
                    await connection.run()
                finally:
                    self._connections.discard(connection)
                    if self.metrics:
                        self.metrics.connections.dec()
        except DEAD_STREAM:
            pass  # a peer going away (or a failed handshake) is not our error
        except Exception:
            log.exception("connection handler failed")
        finally:
            with anyio.CancelScope(shield=True):
                await aclose_quietly(stream)
            self._all_closed.set()

    async def _reject(self, stream: ByteStream, error: MeshnetError) -> None:
        """Answer the first request with ``error``, drain briefly, close.

        The head is read first (bounded) so the answer is proper HTTP; past
        another cap's worth of rejections we just close: a flood gets no bytes.
        """
        if self._rejecting >= self.settings.max_connections:
            return
        self._rejecting += 1
        try:
            conn = self.make_connection()
            with anyio.move_on_after(min(self.settings.head_timeout, 2.0)):
                event = await _read_event(conn, stream)
                if not isinstance(event, ConnectionClosed):
                    self._count(event_path(event), error.status)
                    await _write(stream, anyio.Lock(), conn.send_error(error), 5.0)
                    if conn.needs_drain:
                        await _drain(stream)
        finally:
            self._rejecting -= 1

    def _count(self, path: str, status: int) -> None:
        if self.metrics:
            self.metrics.observe_request(path, status)


def _too_many(retry_after: int) -> CapacityError:
    return CapacityError(
        "too many concurrent connections", code="too_many_connections", retry_after=retry_after
    )


def _shutting_down(retry_after: int) -> CapacityError:
    return CapacityError("server is shutting down", code="shutting_down", retry_after=retry_after)


def _request_timeout(what: str) -> ProtocolError:
    return ProtocolError(f"client too slow to send its request {what}", code="request_timeout",
                         status=408)  # fmt: skip


def _internal_error() -> MeshnetError:
    return MeshnetError("internal server error", code="internal_error", status=500)


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


async def _read_event(
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


async def _write(
    stream: ByteStream, lock: anyio.Lock, parts: Sequence[Any], timeout: float
) -> None:
    """Write ``parts`` in order; a half-written answer is never abandoned to a
    cancellation (it would corrupt the stream), only to the write timeout."""
    parts = coalesce(parts)
    async with lock:
        with anyio.move_on_after(timeout, shield=True) as scope:
            for part in parts:
                if len(part):
                    await stream.send(part)
        if scope.cancelled_caught:
            raise _Closed("write timed out")


async def _drain(stream: ByteStream) -> None:
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


@dataclass(eq=False, slots=True)
class _Connection:
    """One client connection: a loop of request cycles."""

    server: HttpServer
    stream: ByteStream
    conn: ServerConnection = field(init=False)
    # fast_acquire: an uncontended write (the usual case) takes no extra
    # trip through the scheduler (one of three per decode step; section decode).
    lock: anyio.Lock = field(default_factory=lambda: anyio.Lock(fast_acquire=True))
    idle_scope: anyio.CancelScope | None = None
    closed_idle: bool = False  # the idle scope was cancelled by a shutdown
    cycle_bytes: list[int] = field(default_factory=lambda: [0])

    peer: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.conn = self.server.make_connection()
        self.peer = peer_host(self.stream)

    def close_if_idle(self) -> None:
        # Only a connection waiting for a request it has no byte of is idle;
        # one with part of a head will get its 503 shutting_down.
        if self.idle_scope is not None and self.cycle_bytes[0] == 0:
            self.closed_idle = True
            self.idle_scope.cancel()

    async def run(self) -> None:
        try:
            while await self._cycle():
                pass  # the core restarts the cycle itself after an answer
        except _Closed:
            pass

    async def _cycle(self) -> bool:
        """One request and its answer; ``False`` when the connection is done."""
        settings = self.server.settings
        self.cycle_bytes[0] = 0
        event: Any = None
        # One scope for the head timeout and for a shutdown closing an idle
        # connection (one scope fewer per request: section decode);
        # `closed_idle` tells the two apart.
        self.closed_idle = False
        with anyio.move_on_after(settings.head_timeout) as head_scope:
            self.idle_scope = head_scope

            def body_started() -> None:
                # An endpoint's body (a /v1 prompt) gets the body timeout
                # from the end of its head, as a /forward body does.
                head_scope.deadline = anyio.current_time() + settings.body_timeout

            if self.server.draining:
                self.close_if_idle()  # checked here too: shutdown may precede this cycle
            event = await _read_event(
                self.conn, self.stream, self.cycle_bytes, on_body=body_started
            )
        self.idle_scope = None
        if head_scope.cancelled_caught:
            if self.cycle_bytes[0] and not self.closed_idle:
                what = "body" if self.conn.reading_body else "head"
                await self._error("other", _request_timeout(what))
            return False
        ctx = RequestContext(started=anyio.current_time(), path=event_path(event), peer=self.peer)

        if isinstance(event, ConnectionClosed):
            return False
        if isinstance(event, ProtocolErrorReceived):
            await self._error(ctx.path, event.error)
            return False
        if self.server.draining:
            await self._error(ctx.path, _shutting_down(settings.retry_after))
            return False
        if isinstance(event, ActivationHead):
            try:
                await self.server.app.handle_activation_head(event, ctx)
            except MeshnetError as err:
                await self._error(ctx.path, err)
                return False
            except Exception:
                log.exception("handle_activation_head failed")
                await self._error(ctx.path, _internal_error())
                return False
            reservation = None
            if self.server.budget is not None:
                try:
                    reservation = self.server.budget.reserve(self.server.cost(event.headers))
                except MeshnetError as err:  # 503 memory_full, before any body byte
                    await self._error(ctx.path, err)
                    return False
            with reservation or contextlib.nullcontext():
                return await self._activation(event, ctx)
        if isinstance(event, EndpointRequest):
            wants = getattr(self.server.app, "cancel_on_disconnect", None)
            watch = bool(wants is not None and wants(event))
            return await self._handle(self.server.app.handle_endpoint, event, ctx, watch=watch)
        log.error("unexpected event from ServerConnection: %r", event)
        await self._error(ctx.path, _internal_error())
        return False

    async def _activation(self, event: ActivationHead, ctx: RequestContext) -> bool:
        """An accepted head: its body, the application, the answer."""
        settings = self.server.settings
        if event.expects_continue:
            await self._send([self.conn.send_continue()])
        offload = None
        codecs = self.server.codecs
        if (
            codecs is not None
            and event.headers.encoding == "zstd"
            and event.headers.nbytes >= codecs.inline_bytes
        ):
            offload = codecs
        # Reads sized to the body's bound, at least 64 KiB, at most 1 MiB.
        read_size = body_read_size(body_bound(event.headers))
        # A small body usually came with its head: then it is parsed here at
        # once, without a timer (a cancel scope is a few percent of a decode
        # step's node time). Offloaded bodies decode in next_event: a thread.
        received = NEED_DATA if offload is not None else self.conn.next_event()
        if received is NEED_DATA:
            # The sender's deadline bounds the body too: past it nobody waits
            # for the answer, however long our own body timeout is.
            deadline = Deadline.start(ctx.started, settings.body_timeout, event.headers.deadline_ms)
            with anyio.move_on_after(deadline.remaining()) as body_timer:
                received = await _read_event(
                    self.conn, self.stream, offload=offload, read_size=read_size
                )
            if body_timer.cancelled_caught:
                late: MeshnetError = _request_timeout("body")
                if event.headers.deadline_ms is not None and deadline.expired:
                    late = deadline_exceeded()
                await self._error(ctx.path, late)
                return False
        if isinstance(received, ConnectionClosed):
            return False
        if isinstance(received, ProtocolErrorReceived):
            await self._error(ctx.path, received.error)
            return False
        if not isinstance(received, ActivationReceived):
            log.error("unexpected event after ActivationHead: %r", received)
            await self._error(ctx.path, _internal_error())
            return False
        if self.server.metrics:
            self.server.metrics.labelled(self.server.metrics.bytes_in, "upstream").inc(
                received.body_nbytes
            )
        wants = getattr(self.server.app, "cancel_on_disconnect", None)
        watch = bool(wants is not None and wants(received))
        return await self._handle(self.server.app.handle_activation, received, ctx, watch=watch)

    async def _handle(
        self, handler: Any, event: Any, ctx: RequestContext, *, watch: bool = False
    ) -> bool:
        """Run the application on a complete request and write its answer.

        ``watch``: cancel the handler if the client leaves while it works
        (the application's ``cancel_on_disconnect`` asked for it); nobody
        would read the answer, and the connection closes.
        """
        try:
            if watch:
                reply = await self._unless_client_leaves(handler, event, ctx)
                if reply is None:
                    return False
            else:
                reply = await handler(event, ctx)  # type: ignore[arg-type]
        except MeshnetError as err:
            await self._error(ctx.path, err)
            return not self.conn.should_close
        except Exception:
            log.exception("request handler failed on %s", ctx.path)
            await self._error(ctx.path, _internal_error())
            return False
        await self._answer(ctx.path, reply)
        # Finishing the answer in flight is what a graceful shutdown promised;
        # the connection itself ends here.
        return not self.conn.should_close and not self.server.draining

    async def _answer(self, path: str, reply: ActivationReply | Reply | StreamReply) -> None:
        if isinstance(reply, StreamReply):
            await self._stream(path, reply)
            return
        if isinstance(reply, ActivationReply):
            parts = self.conn.send_activation(reply.headers, reply.body)
            status = 200
            if self.server.metrics:
                self.server.metrics.labelled(self.server.metrics.bytes_out, "upstream").inc(
                    len(reply.body)
                )
        else:
            parts = self.conn.send_response(reply.status, list(reply.headers), reply.body)
            status = reply.status
        self.server._count(path, status)
        await self._send(parts)

    async def _until_client_leaves(
        self, on_leave: Callable[[], None], probe: Callable[[], Sequence[Any]]
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
            data = await self.stream.receive(READ_SIZE)
        except anyio.EndOfStream:
            data = b""
        except DEAD_STREAM:
            on_leave()
            return
        if data:
            self.conn.receive_data(data)  # parsed after this answer
            return
        while True:
            parts = probe()
            if not any(len(part) for part in parts):
                return
            try:
                await self._send(parts)
            except _Closed:
                on_leave()
                return
            await anyio.sleep(HALF_CLOSE_PROBE)

    def _interim_probe(self) -> list[bytes]:
        return [self.conn.send_interim()]

    async def _unless_client_leaves(
        self, handler: Any, event: Any, ctx: RequestContext
    ) -> ActivationReply | Reply | StreamReply | None:
        """``handler(event, ctx)``, or None once it was cancelled because the client left."""

        failure: list[Exception] = []

        async def work(leave: Callable[[], None]) -> Any:
            try:
                return await handler(event, ctx)
            except Exception as exc:
                # Raised out of the watching task group it would come out as
                # an ExceptionGroup; re-raised bare, it is answered as usual.
                failure.append(exc)
                return None

        reply, client_gone = await self._watching_client(work, self._interim_probe)
        if failure and not client_gone:
            raise failure[0]
        return None if client_gone else reply

    async def _stream(self, path: str, reply: StreamReply) -> None:
        """Write a streamed answer; cancel its producer when the client leaves."""
        head = self.conn.send_stream_start(reply.status, list(reply.headers))
        self.server._count(path, reply.status)
        await self._send([head])

        async def produce(leave: Callable[[], None]) -> bool:
            async def send(piece: bytes) -> None:
                try:
                    await self._send(self.conn.send_stream_data(piece))
                except _Closed:
                    leave()  # the client is gone: the producer is cancelled here
                    await anyio.lowlevel.checkpoint()
                    raise

            try:
                await reply.produce(send)
            except _Closed:
                return False  # pragma: no cover - send() cancels before this
            except Exception:
                log.exception("streamed answer on %s failed", path)
                return False  # half an answer: closing is the only signal left
            return True

        def heartbeat() -> Sequence[Any]:
            return self.conn.send_stream_data(reply.heartbeat) if reply.heartbeat else []

        whole, client_gone = await self._watching_client(produce, heartbeat)
        if client_gone or not whole:
            raise _Closed("client left mid-stream")
        await self._send(self.conn.send_stream_end())

    async def _watching_client(
        self,
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

            tg.start_soon(self._until_client_leaves, leave, probe)
            result = await work(leave)
            # Stop watching before answering: a streamed answer watches on its own.
            tg.cancel_scope.cancel()
        return (None, True) if client_gone else (result, False)

    async def _error(self, path: str, error: MeshnetError) -> None:
        """Answer ``error`` when the protocol state allows it; drain if closing."""
        try:
            parts = self.conn.send_error(error)
        except Exception:
            # The state does not allow an answer (e.g. a response already
            # started): closing is the only honest signal left.
            log.debug("cannot answer %r on this connection", error, exc_info=True)
            raise _Closed from None
        self.server._count(path, error.status)
        await self._send(parts)
        if self.conn.needs_drain:
            await _drain(self.stream)

    async def _send(self, parts: Sequence[Any]) -> None:
        try:
            await _write(self.stream, self.lock, parts, self.server.settings.write_timeout)
        except DEAD_STREAM as exc:
            raise _Closed from exc
