"""One client connection's request cycles: read a request, hand it to the
application, write its answer; again while the connection stays open.

Each cycle runs under the head timeout (then the body timeout, bounded by
the sender's deadline); an error raised by the application is answered with
``send_error`` while the connection can still answer one
(`ServerConnection.can_send_error`), and any other exception is our bug:
logged, answered 500 ``internal_error`` when it still can, and never taking
down the server or another connection.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import anyio.lowlevel
from anyio.abc import ByteStream

from meshnet_proto import (
    NEED_DATA,
    ActivationHead,
    ActivationReceived,
    ConnectionClosed,
    EndpointRequest,
    MeshnetError,
    ProtocolErrorReceived,
    ServerConnection,
    WireHeaders,
)
from meshnet_proto.lowlevel import ByteBudget, body_bound

from .application import ActivationReply, Application, Reply, RequestContext, StreamReply
from .client_watch import watching_client
from .codec_pool import CodecPool
from .deadlines import Deadline, deadline_exceeded, loop_clock
from .metrics import ServerMetrics
from .phase_deadline import PhaseDeadline
from .server_errors import internal_error, request_timeout, shutting_down
from .server_io import Closed, drain, event_path, peer_host, read_event, write
from .server_settings import ServerSettings
from .streams import DEAD_STREAM, body_read_size
from .transports import coalesce

__all__ = ["ConnectionCycle", "CycleHost"]

log = logging.getLogger("meshnet.server")


class CycleHost(Protocol):
    """What a connection's cycles use of the server that accepted it
    (`meshnet_runtime.http_server.HttpServer`)."""

    app: Application
    settings: ServerSettings
    codecs: CodecPool | None
    budget: ByteBudget | None
    cost: Callable[[WireHeaders], int]
    metrics: ServerMetrics | None
    draining: bool
    drain_seen: float
    # A watchdog ends connections past their phase's deadline (see run).
    watching: bool
    make_connection: Callable[[], ServerConnection]

    def count_answer(self, path: str, status: int) -> None: ...

    def serves_while_draining(self, event: object) -> bool: ...

    def handing_off(self) -> bool: ...


class _Phase(enum.Enum):
    """What the connection's timer times (`ConnectionCycle.run`)."""

    HEAD = "head"  # the head timeout (then an endpoint's body timeout)
    APPLICATION = "application"  # no timeout: the application has its deadlines
    WRITE = "write"  # the write timeout of an answer


@dataclass(eq=False, slots=True)
class ConnectionCycle:
    """One client connection: a loop of request cycles."""

    server: CycleHost
    stream: ByteStream
    conn: ServerConnection = field(init=False)
    # Orders the writes of the tasks that watch a client (`_send_shielded`);
    # fast_acquire: an uncontended one takes no trip through the scheduler.
    lock: anyio.Lock = field(default_factory=lambda: anyio.Lock(fast_acquire=True))
    idle_scope: anyio.CancelScope | None = None
    closed_idle: bool = False  # the idle scope was cancelled by a shutdown
    cycle_bytes: list[int] = field(default_factory=lambda: [0])
    cycles: int = 0  # requests read on this connection
    # The connection's one timer (its scope: `deadline.scope`) and what it is timing now.
    deadline: PhaseDeadline = field(init=False)
    phase: _Phase = _Phase.HEAD

    peer: str | None = field(init=False, default=None)
    # The loop's clock, looked up once (deadlines.loop_clock).
    now: Callable[[], float] = field(init=False, default=anyio.current_time)

    def __post_init__(self) -> None:
        self.conn = self.server.make_connection()
        self.peer = peer_host(self.stream)
        self.now = loop_clock()
        self.deadline = PhaseDeadline(self.now, watched=self.server.watching)

    def close_if_idle(self) -> None:
        # Only a connection waiting for a request it has no byte of is idle;
        # one with part of a head will get its 503 shutting_down.
        if self.idle_scope is not None and self.cycle_bytes[0] == 0:
            self.closed_idle = True
            self.idle_scope.cancel()

    async def run(self) -> None:
        # One cancel scope for the connection's whole life (phase_deadline).
        try:
            with anyio.CancelScope() as timer:
                self.deadline.scope = timer
                await _cycles(self)
            self.deadline.scope = None
            self.idle_scope = None
            if timer.cancelled_caught and self.phase is _Phase.HEAD:
                await self._head_timed_out()
            # A write past its timeout ends the connection: nothing can be said.
        except Closed:
            pass

    async def _head_timed_out(self) -> None:
        """408 for a head (or an endpoint's body) that came too slowly; an
        idle connection (no byte of a request, or closed by a shutdown) just
        closes."""
        if self.cycle_bytes[0] and not self.closed_idle:
            what = "body" if self.conn.reading_body else "head"
            await self._error("other", request_timeout(what))

    async def _cycle(self) -> bool:
        """One request and its answer; ``False`` when the connection is done."""
        settings = self.server.settings
        timer = self.deadline.scope
        assert timer is not None  # run() set it
        self.cycle_bytes[0] = 0
        self.closed_idle = False
        self.phase = _Phase.HEAD
        # Checked here too: shutdown may precede this cycle. A connection's
        # first request while sessions are kept for a hand-off is read (the
        # export may come on it); after its answer it closes. One that holds
        # a pipelined request is not idle: that request gets its 503.
        if self.server.draining and (self.cycles or not self.server.handing_off()):
            event: Any = self.conn.next_event()
            if event is NEED_DATA:
                self.closed_idle = True
                return False
        else:
            self.deadline.expire_in(settings.head_timeout)
            self.idle_scope = timer  # a shutdown closes the connection while it waits

            def body_started() -> None:
                # An endpoint's body (a /v1 prompt) gets the body timeout
                # from the end of its head, as a /forward body does.
                self.deadline.expire_in(settings.body_timeout)

            event = await read_event(self.conn, self.stream, self.cycle_bytes, on_body=body_started)
            self.idle_scope = None
            if timer.cancel_called:
                # The head timer fired (or a shutdown closed the connection)
                # just as the request came, with no checkpoint between: the
                # connection is closing, as when that happens a moment sooner.
                return False
        self.cycles += 1
        self.phase = _Phase.APPLICATION
        self.deadline.clear()  # the application keeps its own deadlines
        ctx = RequestContext(
            started=self.now(), path=event_path(event), peer=self.peer, clock=self.now
        )
        # Whom its credential names (wire-2 §7): the tenant of an API key.
        ctx.tenant = self.conn.principal.tenant

        if isinstance(event, ConnectionClosed):
            return False
        if isinstance(event, ProtocolErrorReceived):
            await self._error(ctx.path, event.error)
            return False
        if self.server.draining:
            self.server.drain_seen = self.now()
        if self.server.draining and not self.server.serves_while_draining(event):
            await self._error(ctx.path, shutting_down(settings.retry_after))
            return False
        try:
            if isinstance(event, ActivationHead):
                return await self._activation_head(event, ctx)
            if isinstance(event, EndpointRequest):
                app = self.server.app
                watch = app.cancel_on_disconnect(event)
                return await self._handle(app.handle_endpoint, event, ctx, watch=watch)
        finally:  # what the request held (a KV import's bytes, an export's copy), however it ended
            for cleanup in ctx.cleanups:
                cleanup()
        log.error("unexpected event from ServerConnection: %r", event)
        await self._error(ctx.path, internal_error())
        return False

    async def _activation_head(self, event: ActivationHead, ctx: RequestContext) -> bool:
        """The application's head checks, the bytes the request will hold, then the rest."""
        try:
            await self.server.app.handle_activation_head(event, ctx)
        except MeshnetError as err:
            await self._error(ctx.path, err)
            return False
        except Exception:
            log.exception("handle_activation_head failed")
            await self._error(ctx.path, internal_error())
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
        # A small body usually came with its head: then it is parsed here at
        # once, without a timer (a cancel scope is a few percent of a decode
        # step's node time). Offloaded bodies decode in next_event: a thread.
        received = NEED_DATA if offload is not None else self.conn.next_event()
        if received is NEED_DATA:
            # The sender's deadline bounds the body too: past it nobody waits
            # for the answer, however long our own body timeout is.
            deadline = _body_deadline(ctx, settings.body_timeout, event.headers.deadline_ms)
            # Reads sized to the body's bound, at least 64 KiB, at most 1 MiB.
            read_size = body_read_size(body_bound(event.headers))
            with anyio.move_on_after(deadline.remaining()) as body_timer:
                received = await read_event(
                    self.conn, self.stream, offload=offload, read_size=read_size
                )
            if body_timer.cancelled_caught:
                late: MeshnetError = request_timeout("body")
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
            await self._error(ctx.path, internal_error())
            return False
        if self.server.metrics:
            self.server.metrics.bytes_in.labels("upstream").inc(received.body_nbytes)
        app = self.server.app
        watch = app.cancel_on_disconnect(received)
        return await self._handle(app.handle_activation, received, ctx, watch=watch)

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
                reply = await handler(event, ctx)
        except MeshnetError as err:
            await self._error(ctx.path, err)
            return not self.conn.should_close
        except Exception:
            log.exception("request handler failed on %s", ctx.path)
            await self._error(ctx.path, internal_error())
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
                self.server.metrics.bytes_out.labels("upstream").inc(len(reply.body))
        else:
            parts = self.conn.send_response(reply.status, list(reply.headers), reply.body)
            status = reply.status
        self.server.count_answer(path, status)
        await self._send(parts, ends_cycle=True)

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

        reply, client_gone = await watching_client(
            self.stream, self.conn, self._send_shielded, work, self._interim_probe
        )
        if failure and not client_gone:
            raise failure[0]
        return None if client_gone else reply

    async def _stream(self, path: str, reply: StreamReply) -> None:
        """Write a streamed answer; cancel its producer when the client leaves."""
        head = self.conn.send_stream_start(reply.status, list(reply.headers))
        self.server.count_answer(path, reply.status)
        await self._send([head])

        async def produce(leave: Callable[[], None]) -> bool:
            async def send(piece: bytes) -> None:
                try:
                    await self._send_shielded(self.conn.send_stream_data(piece))
                except Closed:
                    leave()  # the client is gone: the producer is cancelled here
                    await anyio.lowlevel.checkpoint()
                    raise

            try:
                await reply.produce(send)
            except Closed:
                return False  # pragma: no cover - send() cancels before this
            except Exception:
                log.exception("streamed answer on %s failed", path)
                return False  # half an answer: closing is the only signal left
            return True

        def heartbeat() -> Sequence[Any]:
            return self.conn.send_stream_data(reply.heartbeat) if reply.heartbeat else []

        whole, client_gone = await watching_client(
            self.stream, self.conn, self._send_shielded, produce, heartbeat
        )
        if client_gone or not whole:
            raise Closed("client left mid-stream")
        await self._send(self.conn.send_stream_end())

    async def _error(self, path: str, error: MeshnetError) -> None:
        """Answer ``error`` when the protocol state allows it; drain if closing."""
        if not self.conn.can_send_error:
            # A response already started, or the connection closed: closing
            # is the only honest signal left.
            log.debug("cannot answer %r on this connection", error)
            raise Closed
        parts = self.conn.send_error(error)
        self.server.count_answer(path, error.status)
        await self._send(parts)
        if self.conn.needs_drain:
            await drain(self.stream)

    async def _send(self, parts: Sequence[Any], *, ends_cycle: bool = False) -> None:
        """Write an answer from the cycle's own task, timed by the connection's
        timer (see run); a write past the write timeout ends the connection.

        Unshielded: only this connection's end can cancel the cycle's task
        mid-answer, and then half an answer is as good as none. Writes from
        the tasks that watch a client use `_send_shielded`: their task is
        cancelled when the work ends, while the connection goes on.

        Without the write lock: the cycle's own task writes only when no
        watch runs (`watching_client` returns once its tasks have ended,
        their shielded writes included), so nothing can interleave; the lock
        orders the watchers' writes among themselves and was ~2 % of a decode
        step here (section decode).

        ``ends_cycle``: the cycle's answer; the timer keeps the write's deadline,
        which the next cycle replaces before any checkpoint (~1.7 us saved)."""
        timer = self.deadline.scope
        if timer is None:  # the connection's timer is spent: a last answer
            await self._send_shielded(parts)
            return
        self.phase = _Phase.WRITE
        self.deadline.expire_in(self.server.settings.write_timeout)
        try:
            for part in coalesce(parts):
                if len(part):
                    await self.stream.send(part)
        except DEAD_STREAM as exc:
            raise Closed from exc
        self.phase = _Phase.APPLICATION
        if not ends_cycle:  # back to no timeout: a 100-continue's body, a stream
            self.deadline.clear()

    async def _send_shielded(self, parts: Sequence[Any]) -> None:
        """Write under a timeout of its own, shielded: a task cancelled mid-write
        (a probe when its watch ends) never leaves half an answer behind."""
        try:
            await write(self.stream, self.lock, parts, self.server.settings.write_timeout)
        except DEAD_STREAM as exc:
            raise Closed from exc


async def _cycles(connection: ConnectionCycle) -> None:
    """A connection's request cycles, one after another (the core restarts a
    cycle itself after an answer).

    An answer cut off by its write timeout sits in a reference cycle of its
    exception's frames (anyio re-raises the cancellation from a frame that
    holds it) until the next GC, and its body with it: a KV export's copy,
    hundreds of MB. The frames' locals are let go of at once instead."""
    try:
        while await connection._cycle():
            pass
    except BaseException as exc:
        _clear_frames(exc)
        raise


def _clear_frames(exc: BaseException | None) -> None:
    """Drop the locals of the finished frames ``exc`` and its causes went through."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _body_deadline(ctx: RequestContext, body_timeout: float, deadline_ms: int | None) -> Deadline:
    """A request body's deadline: the server's body timeout, or the shorter one
    the application set at the head (a KV import's), within the sender's."""
    if ctx.body_timeout is not None:
        body_timeout = min(body_timeout, ctx.body_timeout)
    return Deadline.start(ctx.started, body_timeout, deadline_ms)
