"""The serving loop: read, feed the ``ServerConnection``, act, write.

Modelled on hypercorn's trio worker and h11's trio example: per connection,
``receive(64 KiB)`` → ``receive_data`` → ``next_event`` → the application →
``send_*`` → ``stream.send``. Everything the wire means is decided by
``meshnet_proto``; the runtime only owns what needs a clock or a socket:
timeouts (408), the connection cap (503), the drain before an early close,
keep-alive, and graceful shutdown. One concern a module:

* this module — `HttpServer`: accepting, the connection cap, shutdown;
* `application` — the `Application` protocol and the replies it returns;
* `request_cycle` — one connection's request/answer cycles;
* `client_watch` — cancelling work for a client that left;
* `server_io` — reading events, writing answers, draining;
* `server_settings`, `server_errors` — the loop's settings and own errors.

The names other code imports from here stay importable here.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass

import anyio
from anyio.abc import ByteStream, TaskStatus
from anyio.streams.tls import TLSStream

from meshnet_proto import (
    ConnectionClosed,
    EndpointRequest,
    MeshnetError,
    ServerConnection,
    WireHeaders,
)
from meshnet_proto.lowlevel import ByteBudget, request_cost

from .application import (
    ActivationReply,
    Application,
    Reply,
    RequestContext,
    StreamReply,
    StreamSend,
)
from .client_watch import HALF_CLOSE_PROBE
from .codec_pool import CodecPool
from .metrics import ServerMetrics
from .request_cycle import ConnectionCycle
from .server_errors import shutting_down, too_many
from .server_io import (
    DRAIN_BYTES,
    DRAIN_SECONDS,
    OFFLOAD_READ_SIZE,
    drain,
    event_path,
    peer_host,
    read_event,
    write,
)
from .server_settings import ServerSettings
from .streams import DEAD_STREAM, aclose_quietly
from .transports import BoundListener

# Re-exported: what other modules and tests have imported from here.
_write = write
__all__ = [
    "DRAIN_BYTES",
    "DRAIN_SECONDS",
    "HALF_CLOSE_PROBE",
    "OFFLOAD_READ_SIZE",
    "ActivationReply",
    "Application",
    "DrainHandoff",
    "HttpServer",
    "Reply",
    "RequestContext",
    "ServerSettings",
    "StreamReply",
    "StreamSend",
    "event_path",
    "peer_host",
]

log = logging.getLogger("meshnet.server")


# How often a drain looks whether its sessions have been handed off.
HANDOFF_POLL = 0.05


@dataclass(frozen=True, slots=True)
class DrainHandoff:
    """What a draining server keeps serving so its sessions can move by KV
    hand-off (wire-2 §3.11): ``routes`` while ``held()`` sessions remain,
    for up to ``window`` seconds after its requests in flight are done."""

    window: float
    held: Callable[[], int]
    routes: frozenset[str] = frozenset({"/kv/*", "/sessions/*"})
    # The wait also ends when no request came for this long: nobody is
    # moving the sessions (a chain shut down whole, idle clients).
    quiet: float = 2.0


class HttpServer:
    """Serves one application on any number of listeners and streams."""

    def __init__(
        self,
        app: Application,
        make_connection: Callable[[], ServerConnection],
        *,
        settings: ServerSettings = ServerSettings(),  # noqa: B008 - frozen, shared safely
        metrics: ServerMetrics | None = None,
        ssl_context: ssl.SSLContext | None = None,
        codecs: CodecPool | None = None,
        budget: ByteBudget | None = None,
        cost: Callable[[WireHeaders], int] = request_cost,
        on_drain: Callable[[float], int] | None = None,
        handoff: DrainHandoff | None = None,
    ) -> None:
        self.app = app
        # A node's sessions, kept for a KV hand-off while it drains (wire-2 §3.11).
        self.handoff = handoff
        self.drain_seen = 0.0  # when a request last came while draining
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
        # Told the time by which open streams must have ended when a shutdown
        # begins (the gateway ends its OpenAI streams with a final event
        # then); answers how many it will end.
        self.on_drain = on_drain
        self.drain_note = ""  # appended to the drain's log line (how to force it)
        self._shutdown = anyio.Event()
        self._connections: set[ConnectionCycle] = set()
        self.watching = False  # watch_deadlines runs: connections keep no timer of their own
        self._rejecting = 0
        self._all_closed = anyio.Event()

    # ------------------------------------------------------------- lifecycle

    def handing_off(self) -> bool:
        return self.handoff is not None and self.handoff.held() > 0

    def serves_while_draining(self, event: object) -> bool:
        """While draining, only what moves the sessions away is served (the
        export and the DELETE that follows it), and only while some are held."""
        return (
            self.handoff is not None
            and isinstance(event, EndpointRequest)
            and event.route in self.handoff.routes
            and self.handing_off()
        )

    def request_shutdown(self) -> None:
        """Begin a graceful shutdown (safe to call more than once)."""
        self._shutdown.set()

    @property
    def shutdown_requested(self) -> bool:
        return self._shutdown.is_set()

    def _begin_drain(self, deadline: float) -> None:
        """Close idle connections, tell the streams when to end, say what is left."""
        self.draining = True
        for connection in list(self._connections):
            connection.close_if_idle()
        timeout = self.settings.shutdown_timeout
        # Streams end a little before the deadline, so their final event is
        # written before what is still open then is cut.
        streams = self.on_drain(deadline - min(1.0, timeout / 4)) if self.on_drain else 0
        busy = sum(1 for connection in self._connections if not connection.closed_idle)
        if busy == 0:
            log.info("%s shutting down: nothing in flight", self.url)
            return
        ended = f", {streams} of them streams ended before then" if streams else ""
        # The URL: a process may hold several servers (meshnet run: a gateway, its nodes).
        log.warning(
            "%s shutting down: draining %d request%s in flight for up to %g s "
            "(--shutdown-timeout)%s%s",
            self.url,
            busy,
            "" if busy == 1 else "s",
            timeout,
            ended,
            self.drain_note,
        )

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
        left is cancelled. ``on_drain`` is told, at the start, when open
        streams must end (the gateway then ends its OpenAI streams with a
        final event), and one log line says how much is being drained.
        """
        self.url = bound.url
        async with anyio.create_task_group() as connections:
            await connections.start(self.watch_deadlines)
            accepting = anyio.CancelScope()
            accepted = anyio.Event()
            connections.start_soon(self._accept, bound, connections, accepting, accepted)
            task_status.started(bound.url)
            await self._shutdown.wait()
            deadline = anyio.current_time() + self.settings.shutdown_timeout
            self._begin_drain(deadline)
            with anyio.CancelScope(deadline=deadline) as drain:
                # Only requests in flight hold the drain open: a stream of new
                # connections (each rejected at once) must not prolong it.
                while self._connections:
                    self._all_closed = anyio.Event()
                    await self._all_closed.wait()
                await self._wait_for_handoffs()
            accepting.cancel()
            with anyio.CancelScope(shield=True):
                await accepted.wait()  # closing a listener under accept() is an error
                await bound.aclose()
            with anyio.move_on_after(max(drain.deadline - anyio.current_time(), 0)):
                while self._rejecting:
                    self._all_closed = anyio.Event()
                    await self._all_closed.wait()
            connections.cancel_scope.cancel()

    async def watch_deadlines(
        self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """End every connection past its phase's deadline (a head, a body or a
        write too slow), looking each ``settings.watch_interval``; runs until
        cancelled. ``serve`` runs it; an embedder calling ``serve_stream``
        itself may start it first (``await tg.start(server.watch_deadlines)``)
        so that its connections move no timer per request, else each keeps
        its own. A connection started under it is timed by it for its life."""
        self.watching = True
        task_status.started()
        try:
            while True:
                await anyio.sleep(self.settings.watch_interval)
                now = anyio.current_time()
                for connection in list(self._connections):
                    connection.deadline.expire_if_due(now)
        finally:
            self.watching = False

    async def _wait_for_handoffs(self) -> None:
        """Keep the sessions for export up to the hand-off window (within the
        drain's deadline), or until none is left (wire-2 §3.11, draining)."""
        if not self.handing_off():
            return
        assert self.handoff is not None
        log.info(
            "%s keeping %d session(s) for a KV hand-off for up to %g s (--handoff-window)",
            self.url,
            self.handoff.held(),
            self.handoff.window,
        )
        self.drain_seen = anyio.current_time()
        with anyio.move_on_after(self.handoff.window):
            while self.handing_off() and (
                anyio.current_time() - self.drain_seen < self.handoff.quiet
            ):
                await anyio.sleep(HANDOFF_POLL)

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
                        stream,
                        server_side=True,
                        ssl_context=self.ssl_context,
                        standard_compatible=False,
                    )
                if not isinstance(stream, TLSStream):
                    return
            if self.draining and not self.handing_off():
                await self._reject(stream, shutting_down(self.settings.retry_after))
            elif len(self._connections) >= self.settings.max_connections:
                await self._reject(stream, too_many(self.settings.retry_after))
            else:
                connection = ConnectionCycle(self, stream)
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
                event = await read_event(conn, stream)
                if not isinstance(event, ConnectionClosed):
                    self.count_answer(event_path(event), error.status)
                    await write(stream, anyio.Lock(), conn.send_error(error), 5.0)
                    if conn.needs_drain:
                        await drain(stream)
        finally:
            self._rejecting -= 1

    def count_answer(self, path: str, status: int) -> None:
        """One answer of ``status`` on ``path``, in the metrics (when kept)."""
        if self.metrics:
            self.metrics.observe_request(path, status)
