"""The node application: wire-2 ``POST /forward`` through one stage (wire-2 §2-§4).

Thin by design: the core decides (``ServerConnection`` parses and decodes,
``SessionTable`` sequences); this module waits, runs the stage, encodes,
forwards and answers. Per request:

1. head: a spent deadline is 504 at once; ``SessionTable.check_head`` runs
   the header-only sequencing checks before the body is read.
2. body decoded (in a worker thread when large: see ``http_server``), then a
   fingerprint and the ``offer`` loop: ``Wait`` sleeps on the session's
   wake-up event until woken or ``until``; ``Process`` runs the stage and
   reports ``stage_done`` at once, so the next chunk of the session can start
   while this one is still downstream; ``Replay``/``Reforward``/``Join``
   answer a retransmission without running the stage again.
3. last stage: encode the output per ``--wire-dtype``/``--encoding``; with
   ``--next``: forward it and relay the downstream's success unchanged, or its
   error with ``hop`` set to our ``--next`` when the downstream left it null.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
from prometheus_client import Counter

from meshnet_proto import (
    WIRE_VERSION,
    ActivationHead,
    ActivationReceived,
    EndpointRequest,
    ErrorResponse,
    Join,
    MeshnetError,
    Process,
    Reforward,
    Replay,
    ServerConnection,
    SessionTable,
    Wait,
    WireHeaders,
    tensor_fingerprint,
)
from meshnet_proto.lowlevel import ByteBudget, Ticket, request_cost
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.control import ControlEndpoints
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import Downstream, DownstreamPool, key_headers
from meshnet_runtime.http_server import (
    ActivationReply,
    HttpServer,
    Reply,
    RequestContext,
)
from meshnet_runtime.lifecycle import server_settings, server_tls
from meshnet_runtime.metrics import ServerMetrics
from meshnet_runtime.replicas import ReplicaSet, needs_replica_set
from meshnet_runtime.transports import client_ssl_context, listen
from meshnet_runtime.wire_encoder import WireEncoder

from .backends import StageBackend, StageContext, make_stage
from .config import NodeConfig
from .model_stage import stage_from_config

__all__ = ["NodeApp", "RunningNode", "build_node", "node_identity", "serve_node"]

log = logging.getLogger("meshnet.node")

# How often idle sessions are looked for; expiry is at most this late.
_EXPIRY_INTERVAL = 5.0
# The DELETE passed down for a session forgotten while one of its chunks was
# on its way down: bounded, a hung downstream is left to its TTL.
_ORPHAN_DELETE_TIMEOUT = 10.0


@dataclass(eq=False, slots=True)
class _Outcome:
    """The answer of one in-flight stage run, for retransmissions that ``Join`` it."""

    done: anyio.Event = field(default_factory=anyio.Event)
    reply: ActivationReply | None = None
    error: MeshnetError | None = None

    def finish(self, reply: ActivationReply | None, error: MeshnetError | None) -> None:
        if not self.done.is_set():
            self.reply, self.error = reply, error
            self.done.set()


class NodeApp:
    """The ``Application`` (see ``meshnet_runtime.http_server``) of one node."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        stage: StageBackend | None = None,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.config = config
        self.limits = config.limits
        self.stage: StageBackend = stage or make_stage(config.backend, config.delay_ms)
        # What this node serves (wire-2 §6.1): fixed for the process's life,
        # so computed once; the chain check compares it across hops.
        self.identity = node_identity(self.stage, config.wire_dtype, config.encoding)
        # (model, first layer, stop layer) of it, or None (a stub, a stage
        # without layers): what X-Meshnet-Stage is checked against on the
        # way in and what it says on the way down (wire-2 §3.2 step 0).
        self.stage_key: tuple[str, int, int] | None = _stage_key(self.identity)
        # Whenever the table forgets a session (DELETE, TTL, expiry to make
        # room), the stage frees what it keeps for it (a model's KV cache).
        self.table = SessionTable(self.limits, on_forget=self._forgotten)
        # Chunks of each session between admission and their answer, and the
        # sessions forgotten meanwhile: see _pass_forget_down.
        self._busy: collections.Counter[str] = collections.Counter()
        self._orphans: set[str] = set()
        # The session key of each session with a chunk in flight: the DELETE
        # passed down for an orphan must carry it (wire-2 §3.9).
        self._keys: dict[str, str | None] = {}
        self.metrics = metrics or ServerMetrics("node")
        self.metrics.sessions.set_function(lambda: len(self.table))
        self.stage.bind_metrics(self.metrics.registry)  # its own gauges (a model's KV cache)
        self.codecs = CodecPool(limits=self.limits, metrics=self.metrics)
        # Tokens the stage ran on (replays included): what a failover cost here.
        self.stage_tokens = Counter(
            "meshnet_stage_tokens", "Tokens the stage computed", registry=self.metrics.registry
        )
        self.tokens_computed = 0
        self.downstream: Downstream | None = None
        replicas = config.next_replicas or ((config.next,) if config.next else ())
        if needs_replica_set(replicas):
            # Several nodes serve the next stage: sessions stick, fail over, replay.
            self.downstream = ReplicaSet(
                replicas,
                limits=self.limits,
                token=config.token,
                ssl_context=client_ssl_context(config.tls_ca) if replicas[0].tls else None,
                metrics=self.metrics,
                health_interval=config.health_interval,
                probe_timeout=config.probe_timeout,
                max_history_bytes=config.max_history_bytes,
            )
        elif config.next is not None:
            self.downstream = DownstreamPool(
                config.next,
                limits=self.limits,
                token=config.token,
                ssl_context=client_ssl_context(config.tls_ca) if config.next.tls else None,
                metrics=self.metrics,
            )
        # --encoding auto toward --next also weighs the link's speed.
        self.encoder = WireEncoder(
            self.codecs,
            dtype_policy=config.wire_dtype,
            encoding=config.encoding,
            level=config.zstd_level,
            link=self.downstream.link if self.downstream is not None else None,
        )
        self._wakeups: dict[str, anyio.Event] = {}
        self._outcomes: dict[int, _Outcome] = {}
        self.control = ControlEndpoints(
            role="node",
            metrics=self.metrics,
            downstream=self.downstream,
            timeout=config.timeout,
            info=self.info,
            end_here=self._end_here,
            identity=self.identity,
            reorder_window=self.limits.reorder_window,
            owner=self._owner,
        )

    def make_connection(self) -> ServerConnection:
        return ServerConnection(limits=self.limits, token=self.config.token)

    # ------------------------------------------------------------ activations

    async def handle_activation_head(self, event: ActivationHead, ctx: RequestContext) -> None:
        if event.headers.deadline_ms == 0:
            Deadline(ctx.started).check()
        if event.headers.stage is not None:
            self._check_stage(event.headers.stage)
        # A stage may refuse by shape and dtype alone (a model's stage).
        self.stage.check_head(event.headers.shape, event.headers.dtype, event.headers.position)
        self.table.check_head(
            event.headers, anyio.current_time(), replay=event.replay, client=ctx.peer
        )

    def _check_stage(self, expected: str) -> None:
        """409 ``stage_mismatch`` unless this node is the stage the sender
        expects to enter (wire-2 §3.2 step 0): checked before anything about
        the chunk, so a chunk meant for another stage changes nothing here."""
        key = self.stage_key
        if key is not None and expected == f"{key[0]}/{key[1]}":
            return
        here = (
            "a stage without layers (a stub)"
            if key is None
            else f"{key[0]}/{key[1]} (layers {key[1]}:{key[2]})"
        )
        raise MeshnetError(
            f"x-meshnet-stage: the sender expects stage {expected}, this node is {here}",
            code="stage_mismatch",
            status=409,
            header="x-meshnet-stage",
        )

    async def handle_activation(
        self, event: ActivationReceived, ctx: RequestContext
    ) -> ActivationReply:
        headers = event.headers
        # A replay (docs/failover.md): an upstream hop rebuilds this node's
        # state for a session that failed over to it; nothing goes further.
        # It never rewrites a live session (the table: 409 session_exists).
        replay = event.replay
        deadline = Deadline.start(ctx.started, self.config.timeout, headers.deadline_ms)
        fingerprint = await self.codecs.run(headers.nbytes, tensor_fingerprint, event.tensor)
        waiter = None
        timed_out = False
        while True:
            now = anyio.current_time()
            try:
                decision = self.table.offer(
                    headers,
                    fingerprint,
                    now,
                    waiter=waiter,
                    deadline=deadline.at,
                    replay=replay,
                    client=ctx.peer,
                )
            except MeshnetError:
                if timed_out:  # the table ended the wait (wire-2 §3.3)
                    self._count("wait_timeout")
                    # Wake the session's other waiters (they re-offer and wait
                    # again on a fresh event) so its wake-up event is not left
                    # behind: for a session that never starts, nothing else
                    # would ever pop it, and those would pile up.
                    assert headers.session is not None
                    self._wake(headers.session)
                raise
            if isinstance(decision, Wait):
                waiter = decision.waiter
                assert headers.session is not None
                wake = self._wakeups.setdefault(headers.session, anyio.Event())
                try:
                    with anyio.move_on_after(decision.until - now) as timer:
                        await wake.wait()
                except anyio.get_cancelled_exc_class():
                    # Cancelled from outside (shutdown, a caller's scope): the
                    # table must not keep a place for a chunk nobody will offer.
                    self.table.give_up(waiter, anyio.current_time())
                    raise
                # At until, offer again rather than give up: the table knows
                # whether the session progressed meanwhile (its predecessor
                # may be in the stage now), which stops the reorder timer.
                timed_out = timer.cancelled_caught
                continue
            if isinstance(decision, Process):
                self._count("processed")
                return await self._run(decision.ticket, headers, event, deadline, replay=replay)
            if isinstance(decision, Reforward):
                self._count("reforwarded")
                return await self._run(decision.ticket, headers, None, deadline,
                                       decision.stage_output, replay=replay)  # fmt: skip
            if isinstance(decision, Replay):
                self._count("replayed")
                return decision.response  # type: ignore[no-any-return]
            assert isinstance(decision, Join)
            self._count("joined")
            return await self._join(decision.ticket, deadline)

    async def _run(
        self,
        ticket: Ticket,
        headers: WireHeaders,
        event: ActivationReceived | None,
        deadline: Deadline,
        stage_output: Any = None,
        *,
        replay: bool = False,
    ) -> ActivationReply:
        """Run the stage (unless reforwarding), then deliver; every exit reports
        the ticket's outcome to the table and to any joined retransmission."""
        outcome = self._outcomes[ticket.serial] = _Outcome()
        self._busy[ticket.session] += 1
        self._keys[ticket.session] = headers.session_key
        try:
            if event is not None:
                stage_output = await self._stage(ticket, headers, event, deadline)
            reply = await self._deliver(ticket, headers, stage_output, deadline, replay=replay)
            outcome.finish(reply, None)
            return reply
        except MeshnetError as err:
            outcome.finish(None, err)
            raise
        finally:
            if not outcome.done.is_set():  # cancelled: joined retransmissions must not hang
                outcome.finish(None, _gone())
            del self._outcomes[ticket.serial]
            await self._chunk_ended(ticket.session)

    def _forgotten(self, session: str) -> None:
        """The table forgot ``session``: the stage frees its state at once, and
        the hop's replay history for it goes too."""
        self.stage.end_session(session)
        if self.downstream is not None:
            self.downstream.forget(session)
        if self._busy.get(session):
            self._orphans.add(session)

    async def _chunk_ended(self, session: str) -> None:
        self._busy[session] -= 1
        if self._busy[session] > 0:
            return
        del self._busy[session]
        key = self._keys.pop(session, None)
        if session in self._orphans:
            self._orphans.discard(session)
            await self._pass_forget_down(session, key)

    async def _pass_forget_down(self, session: str, key: str | None = None) -> None:
        """DELETE a session below us again after a chunk of it went down.

        The session was forgotten here (DELETE, TTL, eviction) while one of
        its chunks was computing or on its way down; a DELETE passed down
        then may have overtaken that chunk, which then started the session
        afresh below — with a KV cache nobody would ever end but the TTL.
        Shielded and bounded: this runs in the ``finally`` of a request that
        may be cancelled (its client left).
        """
        if self.downstream is None or session in self.table:
            return  # last stage, or the session was started again meanwhile
        with anyio.CancelScope(shield=True):
            try:
                await self.downstream.request(
                    "DELETE",
                    f"/sessions/{session}",
                    Deadline.after(_ORPHAN_DELETE_TIMEOUT),
                    key_headers(key),
                )
            except MeshnetError as exc:
                log.warning("could not pass the end of session %s down: %s", session, exc)

    async def _stage(
        self, ticket: Ticket, headers: WireHeaders, event: ActivationReceived, deadline: Deadline
    ) -> Any:
        started = time.perf_counter()
        context = StageContext(
            session=ticket.session,
            position=ticket.position,
            tokens=ticket.tokens,
            index=ticket.index,
            total=headers.chunk_total or 1,
            run=ticket.run,
            # The loop's clock is not the thread's: hand the stage a monotonic one.
            deadline=time.monotonic() + deadline.remaining(),
        )
        try:
            output = await self.stage(event.tensor, context)
        except BaseException as exc:
            self.table.stage_failed(ticket, anyio.current_time())
            self._wake(ticket.session)
            if isinstance(exc, MeshnetError):  # the stage's own 4xx/503: answered as is
                raise
            if isinstance(exc, Exception):
                log.exception("stage %s failed", self.stage.name)
                raise MeshnetError(
                    f"stage {self.stage.name} failed: {type(exc).__name__}",
                    code="internal_error",
                    status=500,
                ) from exc
            raise
        self.metrics.stage_seconds.observe(time.perf_counter() - started)
        self.stage_tokens.inc(ticket.tokens)
        self.tokens_computed += ticket.tokens
        self.table.stage_done(ticket, output, anyio.current_time())
        self._wake(ticket.session)  # the next chunk may start while this one is downstream
        return output

    async def _deliver(
        self,
        ticket: Ticket,
        headers: WireHeaders,
        output: Any,
        deadline: Deadline,
        *,
        replay: bool = False,
    ) -> ActivationReply:
        dtype, encoding, body = await self.encoder.encode(output, headers.encoding)
        # X-Meshnet-Stage is request-only: the answer never carries one, and
        # what goes down names the stage that starts where ours stops. What
        # goes down keeps the session key (the session's, not the hop's:
        # wire-2 §3.9); what is answered never carries it.
        stage_key = self.stage_key
        out = headers.replace(
            shape=tuple(output.shape),
            dtype=dtype,
            encoding=encoding,
            position=ticket.position,
            deadline_ms=None,
            stage=None,
        )
        down = out if stage_key is None else out.replace(stage=f"{stage_key[0]}/{stage_key[2]}")
        if replay and self.downstream is not None:
            # Kept as if sent: a failover of the hop below replays it.
            self.downstream.record_replayed(ticket.session, down, body)
        if self.downstream is None or replay:
            reply = ActivationReply(out.replace(session_key=None), body)
            self.table.response_ready(
                ticket, reply, anyio.current_time(), nbytes=memoryview(reply.body).nbytes
            )
            return reply
        # What a reforward would need is the stage output: count it against the
        # stored-bytes budget while it is kept.
        kept = output.nbytes  # an ndarray: Stage checks what a stage returns
        try:
            response = await self.downstream.forward(down, body, deadline)
        except BaseException:
            self.table.forward_failed(ticket, anyio.current_time(), nbytes=kept)
            raise
        if isinstance(response, ErrorResponse):
            self.table.forward_failed(ticket, anyio.current_time(), nbytes=kept)
            raise response.to_error(hop=self.downstream.url)
        # Relayed unchanged: the last node's headers and body as received —
        # less a stage header or a session key a careless downstream might
        # have sent back (both are request-only).
        relayed = response.headers
        if relayed.stage is not None or relayed.session_key is not None:
            relayed = relayed.replace(stage=None, session_key=None)
        reply = ActivationReply(relayed, response.body)
        self.table.response_ready(
            ticket, reply, anyio.current_time(), nbytes=memoryview(reply.body).nbytes
        )
        return reply

    async def _join(self, ticket: Ticket, deadline: Deadline) -> ActivationReply:
        outcome = self._outcomes.get(ticket.serial)
        if outcome is None:  # cannot happen: a ticket in flight has its outcome
            raise _gone()
        with anyio.move_on_after(max(deadline.remaining(), 0)):
            await outcome.done.wait()
        if not outcome.done.is_set():
            deadline.check()
        if outcome.error is not None:
            raise outcome.error
        assert outcome.reply is not None
        return outcome.reply

    @property
    def sessions_with_waiters(self) -> int:
        """Sessions whose chunks sleep until woken (each holds one wake-up event)."""
        return len(self._wakeups)

    def _wake(self, session: str) -> None:
        event = self._wakeups.pop(session, None)
        if event is not None:
            event.set()

    def _count(self, outcome: str) -> None:
        self.metrics.labelled(self.metrics.chunks, outcome).inc()

    # ------------------------------------------------------------ endpoints

    async def handle_endpoint(self, event: EndpointRequest, ctx: RequestContext) -> Reply:
        return await self.control.handle(event, ctx)

    def info(self) -> dict[str, Any]:
        limits = self.limits
        return {
            "role": "node",
            "wire": WIRE_VERSION,
            "stage": self.stage.describe(),
            "downstream": self.downstream.url if self.downstream else None,
            "replicas": self.downstream.describe() if self.downstream else None,
            "stage_tokens": self.tokens_computed,
            "reorder_window": limits.reorder_window,
            "limits": self.config.limits_info(),
            "wire_dtype": self.config.wire_dtype,
            "encoding": self.config.encoding,
            "auto_encoding": self.encoder.describe(),
            "sessions": len(self.table),
            "identity": self.identity,
        }

    def _owner(self, session: str, key: str | None) -> str | None:
        """A DELETE's key may end ``session`` here (else 403); it goes down as is."""
        self.table.check_owner(session, key)
        return key

    def _end_here(self, session: str) -> bool:
        known = self.table.end_session(session)
        self._wake(session)  # its waiters find it gone
        return known

    # ------------------------------------------------------------ upkeep

    async def maintain(self) -> None:
        """Forget idle sessions (TTL), waking anything that waits on them."""
        interval = min(self.limits.session_ttl / 4, _EXPIRY_INTERVAL)
        async with anyio.create_task_group() as tg:
            if self.downstream is not None:
                tg.start_soon(self.downstream.maintain)  # a replica set's probes, DNS
            while True:
                await anyio.sleep(interval)
                for session in self.table.expire(anyio.current_time()):
                    self._wake(session)

    async def aclose(self) -> None:
        if self.downstream is not None:
            await self.downstream.aclose()


def _stage_key(identity: dict[str, Any]) -> tuple[str, int, int] | None:
    """``(model, start, stop)`` from the node's identity, when it has layers."""
    layers = identity.get("layers")
    if layers is None:
        return None
    start, stop = layers
    key = (str(identity["model"]), int(start), int(stop))
    # A model id X-Meshnet-Stage cannot carry is a bug of the stage: say so
    # at start, not on every chunk.
    WireHeaders(shape=(1,), dtype="int32", stage=f"{key[0]}/{key[2]}")
    return key


def node_identity(stage: StageBackend, wire_dtype: str, encoding: str) -> dict[str, Any]:
    """The ``identity`` of a node's ``/info`` (wire-2 §6.1): the stage's
    fields, the wire settings, and the fingerprint over all of them.
    """
    fields = dict(stage.identity())
    fields.pop("fingerprint", None)
    fields["wire_dtype"] = wire_dtype
    fields["encoding"] = encoding
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    digest = hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()
    return {"fingerprint": digest, **fields}


def _gone() -> MeshnetError:
    return MeshnetError(
        "the original request for this chunk ended without an answer",
        code="internal_error",
        status=500,
    )


# ------------------------------------------------------------------ running


def build_node(
    config: NodeConfig, *, stage: StageBackend | None = None
) -> tuple[NodeApp, HttpServer]:
    """The application and its server, not yet listening.

    Without ``stage``: the model of ``--model`` (loaded here; ``ValueError`` if
    it cannot be), else the ``--backend`` stub.
    """
    if stage is None and config.model is not None:
        stage = stage_from_config(config)
    metrics = ServerMetrics("node")
    app = NodeApp(config, stage=stage, metrics=metrics)
    settings = server_settings(config)
    ssl_context = server_tls(config)
    server = HttpServer(
        app,
        app.make_connection,
        settings=settings,
        metrics=metrics,
        ssl_context=ssl_context,
        codecs=app.codecs,
        budget=ByteBudget(app.limits.max_inflight_bytes, retry_after=settings.retry_after),
        cost=partial(request_cost, relaying=app.downstream is not None),
    )
    return app, server


@dataclass(slots=True)
class RunningNode:
    url: str
    app: NodeApp
    server: HttpServer


@asynccontextmanager
async def serve_node(
    config: NodeConfig, *, stage: StageBackend | None = None
) -> AsyncIterator[RunningNode]:
    """Run a node in this process (tests, ``meshnet demo``); graceful shutdown on exit."""
    app, server = build_node(config, stage=stage)
    bound = await listen(host=config.host, port=config.port, uds=config.uds, tls=config.tls)
    try:
        async with anyio.create_task_group() as tg:
            # Its own scope: a server that stops early (a test shutting one
            # node of a chain down) must end the expiry loop, not cancel the
            # caller's body, which runs inside this task group.
            maintenance = anyio.CancelScope()

            async def maintain() -> None:
                with maintenance:
                    await app.maintain()

            async def run(*, task_status: anyio.abc.TaskStatus[str]) -> None:
                await server.serve(bound, task_status=task_status)
                maintenance.cancel()

            tg.start_soon(maintain)
            url = await tg.start(run)
            try:
                yield RunningNode(url, app, server)
            finally:
                server.request_shutdown()
    finally:
        with anyio.CancelScope(shield=True):
            await app.aclose()
