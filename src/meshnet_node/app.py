"""The node application: wire-2 ``POST /forward`` through one stage (wire-2 §2-§4).

Thin by design: the core decides (``ServerConnection`` parses and decodes,
``SessionTable`` sequences); this module waits, runs the stage, encodes,
forwards and answers. Per request:

1. head: a spent deadline is 504 at once; ``SessionTable.check_head`` runs
   the header-only sequencing checks before the body is read.
2. body decoded (in a worker thread when large: see ``http_server``), then a
   fingerprint and ``SequencedTable.admit`` (``meshnet_runtime.sequencing``:
   a chunk told ``Wait`` sleeps until woken or ``until``); ``Process`` runs
   the stage and reports ``stage_done`` at once, so the next chunk of the
   session can start while this one is still downstream;
   ``Replay``/``Reforward``/``Join`` answer a retransmission without running
   the stage again.
3. last stage: encode the output per ``--wire-dtype``/``--encoding``; with
   ``--next``: forward it and relay the downstream's success unchanged, or its
   error with ``hop`` set to our ``--next`` when the downstream left it null.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import anyio

from meshnet_proto import (
    WIRE_VERSION,
    ActivationHead,
    ActivationReceived,
    EndpointRequest,
    ErrorCode,
    ErrorResponse,
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
from meshnet_proto.lowlevel import Ticket
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.control import ControlEndpoints
from meshnet_runtime.credentials import chain_credentials
from meshnet_runtime.deadlines import Deadline, loop_clock
from meshnet_runtime.downstream import Downstream
from meshnet_runtime.http_server import (
    ActivationReply,
    Reply,
    RequestContext,
)
from meshnet_runtime.metrics import ServerMetrics, Tally
from meshnet_runtime.sequencing import SequencedTable
from meshnet_runtime.wire_encoder import WireEncoder

from .backends import StageBackend, StageContext, make_stage, stage_context
from .config import NodeConfig
from .draw import check_sampled_head
from .drawn_answers import DrawnAnswers
from .forgetting import InFlight
from .handoff import KVHandoff
from .identity import StageKey, check_stage, node_identity, stage_key
from .kv_transfers import KVTransfers
from .next_hop import next_hop
from .outgoing import REQUEST_ONLY, outgoing_changes, relayed_headers
from .windows import SampledAnswers, check_drafted_ids, logit_rows

__all__ = ["NodeApp", "node_identity"]

log = logging.getLogger("meshnet.node")

# How often idle sessions are looked for; expiry is at most this late.
_EXPIRY_INTERVAL = 5.0


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
        self.credentials = chain_credentials(config)
        self.stage: StageBackend = stage or make_stage(config.backend, config.delay_ms)
        # What this node serves (wire-2 §6.1): fixed for the process's life,
        # so computed once; the chain check compares it across hops.
        self.identity = node_identity(self.stage, config.wire_dtype, config.encoding)
        # (model, first layer, stop layer) of it, or None (a stub, a stage
        # without layers): what X-Meshnet-Stage is checked against on the
        # way in and what it says on the way down (wire-2 §3.2 step 0).
        self.stage_key: StageKey | None = stage_key(self.identity)
        # Whenever the table forgets a session (DELETE, TTL, expiry to make
        # room), the stage frees what it keeps for it (a model's KV cache).
        self.table = SessionTable(self.limits, on_forget=self._forgotten)
        # The table's waits, wake-ups and joins (meshnet_runtime.sequencing).
        self.seq: SequencedTable[ActivationReply] = SequencedTable(
            self.table,
            on_wait_timeout=lambda: self._count("wait_timeout"),
            clock=lambda: self._clock(),  # the connections' loop clock, as handed over
        )
        self.metrics = metrics or ServerMetrics("node")
        self.metrics.sessions.set_function(lambda: len(self.table))
        self.stage.bind_metrics(self.metrics.registry)  # its own gauges (a model's KV cache)
        self.codecs = CodecPool(limits=self.limits, metrics=self.metrics)
        # Tokens the stage ran on (replays included): what a failover cost here.
        self.stage_tokens = Tally(
            "meshnet_stage_tokens", "Tokens the stage computed", registry=self.metrics.registry
        )
        self.tokens_computed = 0
        # The loop's clock, as the connections hand it over (RequestContext.clock).
        self._clock: Callable[[], float] = anyio.current_time
        self.downstream: Downstream | None = next_hop(config, self.metrics)
        # Sessions forgotten while a chunk of theirs was on its way down.
        self.in_flight = InFlight(self.downstream, self.table.__contains__)
        # --encoding auto toward --next also weighs the link's speed.
        self.encoder = WireEncoder(
            self.codecs,
            dtype_policy=config.wire_dtype,
            encoding=config.encoding,
            level=config.zstd_level,
            link=self.downstream.link if self.downstream is not None else None,
        )
        # A drawn token's answer: tiny, exact, never recast (wire-2 §3.13).
        self.answer_encoder = WireEncoder(self.codecs, encoding="identity")
        # Sessions moved by their KV (wire-2 §3.11): GET /kv/{id}, POST /forward?kv=1.
        self.handoff = KVHandoff(
            self.table,
            self.stage.kv_store(),
            self.identity["fingerprint"],
            end_session=self.stage.end_session,
            codecs=self.codecs,
            registry=self.metrics.registry,
            transfers=KVTransfers(config.max_kv_transfers, config.max_kv_transfers_per_peer),
            import_timeout=min(config.kv_import_timeout, config.timeout),
        )
        # The tokens this last stage drew, for the gateway's direct poll (§3.14).
        self.drawn = DrawnAnswers(self.table, config.timeout)
        self.answers = SampledAnswers(self.codecs, self.metrics.registry)  # §3.13, §3.16
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
            export_kv=self.handoff.export,
            drawn=self.drawn.endpoint,
        )

    def make_connection(self) -> ServerConnection:
        # The chain's token(s) only (wire-2 §7): clients' API keys are a
        # gateway's; a node serves its chain.
        return ServerConnection(limits=self.limits, credentials=self.credentials)

    # ------------------------------------------------------------ activations

    async def handle_activation_head(self, event: ActivationHead, ctx: RequestContext) -> None:
        if event.kv_import:  # neither a chunk nor a replay: its own checks (wire-2 §3.11)
            self.handoff.check_head(event.headers, ctx)
            return
        if event.headers.deadline_ms == 0:
            Deadline(ctx.started).check()
        if event.headers.stage is not None:
            check_stage(self.stage_key, event.headers.stage)
        # A stage may refuse by shape and dtype alone (a model's stage).
        self.stage.check_head(event.headers.shape, event.headers.dtype, event.headers.position)
        if event.headers.sample is not None and self.downstream is None:
            # This node draws (wire-2 §3.13): refused now if it makes no logits.
            check_sampled_head(self.identity.get("output", "any"))
        self.table.check_head(
            event.headers, ctx.started, replay=event.replay, client=client_of(event.headers, ctx)
        )

    async def handle_activation(
        self, event: ActivationReceived, ctx: RequestContext
    ) -> ActivationReply | Reply:
        headers = event.headers
        self._clock = ctx.clock
        if event.kv_import:
            return await self.handoff.import_(headers, event.tensor, ctx)
        check_drafted_ids(headers, event.tensor)  # a window's ids (§3.16): before anything
        # A replay (docs/failover.md): an upstream hop rebuilds this node's
        # state for a session that failed over to it; nothing goes further.
        # It never rewrites a live session (the table: 409 session_exists).
        replay = event.replay
        deadline = Deadline.start(ctx.started, self.config.timeout, headers.deadline_ms)
        nbytes = headers.nbytes
        fingerprint = (  # a decode step's: at once, without a coroutine
            tensor_fingerprint(event.tensor)
            if nbytes < self.codecs.inline_bytes
            else await self.codecs.run(nbytes, tensor_fingerprint, event.tensor)
        )
        # Offered at once: only a chunk told to wait takes admit's coroutine.
        client = client_of(headers, ctx)
        decision = self.seq.offer(headers, fingerprint, deadline, replay=replay, client=client)
        if isinstance(decision, Wait):
            decision = await self.seq.admit(
                headers, fingerprint, deadline, replay=replay, client=client, first=decision
            )
        if isinstance(decision, Process):
            self._count("processed")
            return await self._run(decision.ticket, headers, event, deadline, replay=replay)
        if isinstance(decision, Reforward):
            self._count("reforwarded")
            return await self._run(
                decision.ticket, headers, None, deadline, decision.stage_output, replay=replay
            )
        if isinstance(decision, Replay):
            self._count("replayed")
            return decision.response  # type: ignore[no-any-return]
        self._count("joined")
        return await self.seq.join(decision.ticket, deadline)

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
        the ticket's outcome to the table and to any joined retransmission
        (``SequencedTable.run``'s steps, inline: two coroutines fewer a step)."""
        self.in_flight.started(ticket.session, headers.session_key)
        outcome = self.seq.begin(ticket)
        try:
            output = stage_output
            if event is not None:
                output = await self._stage(ticket, headers, event, deadline)
            reply = await self._deliver(ticket, headers, output, deadline, replay=replay)
            outcome.finish(reply, None)
            return reply
        except MeshnetError as err:
            outcome.finish(None, err)
            raise
        finally:
            self.seq.end(ticket, outcome)
            orphan = self.in_flight.ended(ticket.session)
            if orphan is not None:
                await self.in_flight.pass_forget_down(*orphan)

    def _forgotten(self, session: str) -> None:
        """The table forgot ``session``: the stage frees its state at once, and
        the hop's replay history for it goes too."""
        self.stage.end_session(session)
        self.drawn.forget(session)
        if self.downstream is not None:
            self.downstream.forget(session)
        self.in_flight.forgotten(session)

    async def _stage(
        self, ticket: Ticket, headers: WireHeaders, event: ActivationReceived, deadline: Deadline
    ) -> Any:
        started = time.perf_counter()
        # The loop's clock is not the thread's: hand the stage a monotonic one.
        context = _chunk_context(ticket, headers, time.monotonic() + (deadline.at - self._clock()))
        self.drawn.rewound(ticket)  # a rewind's: those kept past it were the old line's
        try:
            output = await self.stage(event.tensor, context)
        except BaseException as exc:
            self.seq.stage_failed(ticket)
            if isinstance(exc, MeshnetError):  # the stage's own 4xx/503: answered as is
                raise
            if isinstance(exc, Exception):
                log.exception("stage %s failed", self.stage.name)
                raise MeshnetError(
                    f"stage {self.stage.name} failed: {type(exc).__name__}",
                    code=ErrorCode.INTERNAL_ERROR,
                ) from exc
            raise
        self.metrics.stage_seconds.observe(time.perf_counter() - started)
        self.stage_tokens.inc(ticket.tokens)
        self.tokens_computed += ticket.tokens
        self.seq.stage_done(ticket, output)  # the next chunk may start while this one is down
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
        encoder = self.encoder
        if headers.sample is not None and self.downstream is None:
            # The answer is the drawn token (wire-2 §3.13) or a window's
            # (§3.16), sent as made: a dtype policy must not round its ids.
            output = await self.answers.answer(output, headers, ticket)
            encoder = self.answer_encoder
        encoded = encoder.encode_now(output, headers.encoding)
        if encoded is None:
            encoded = await encoder.encode(output, headers.encoding)
        dtype, encoding, body = encoded
        # X-Meshnet-Stage is request-only: the answer never carries one, and
        # what goes down names the stage that starts where ours stops. What
        # goes down keeps the session key (the session's, not the hop's:
        # wire-2 §3.9); what is answered never carries it.
        stage_key = self.stage_key
        shape, position = output.shape, ticket.position
        if self.downstream is None:
            # The last stage: what is answered is all there is (one copy of
            # the headers, not two: section decode).
            changes = outgoing_changes(headers, shape, dtype, encoding, position, answer=True)
            reply = ActivationReply(headers.replace(**changes), body)
            self.table.response_ready(
                ticket, reply, self._clock(), nbytes=memoryview(reply.body).nbytes
            )
            if headers.sample is not None:
                self.drawn.publish(ticket.session, ticket.position, reply)
            return reply
        out = headers.replace(
            **outgoing_changes(headers, shape, dtype, encoding, position, answer=False)
        )
        down = out if stage_key is None else out.replace(stage=f"{stage_key[0]}/{stage_key[2]}")
        if replay:
            # Kept as if sent: a failover of the hop below replays it.
            self.downstream.record_replayed(ticket.session, down, body)
            reply = ActivationReply(out.replace(**REQUEST_ONLY), body)
            self.table.response_ready(
                ticket, reply, self._clock(), nbytes=memoryview(reply.body).nbytes
            )
            return reply
        # What a reforward would need is the stage output: count it against the
        # stored-bytes budget while it is kept.
        kept = output.nbytes  # an ndarray: Stage checks what a stage returns
        try:
            response = await self.downstream.forward(down, body, deadline)
        except BaseException:
            self.table.forward_failed(ticket, self._clock(), nbytes=kept)
            raise
        if isinstance(response, ErrorResponse):
            self.table.forward_failed(ticket, self._clock(), nbytes=kept)
            raise response.to_error(hop=self.downstream.url)
        # Relayed unchanged: the last node's headers and body as received.
        reply = ActivationReply(relayed_headers(response.headers), response.body)
        self.table.response_ready(
            ticket, reply, self._clock(), nbytes=memoryview(reply.body).nbytes
        )
        return reply

    @property
    def sessions_with_waiters(self) -> int:
        """Sessions whose chunks sleep until woken (each holds one wake-up event)."""
        return self.seq.sessions_with_waiters

    def _count(self, outcome: str) -> None:
        self.metrics.chunks.labels(outcome).inc()

    # ------------------------------------------------------------ endpoints

    async def handle_endpoint(
        self, event: EndpointRequest, ctx: RequestContext
    ) -> Reply | ActivationReply:
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
            # Chunks admitted and not yet answered (the chain view's load).
            "inflight": self.in_flight.count,
            "identity": self.identity,
            # The registration a replica set reads (wire-2 §3.12); null: no KV.
            "handoff": self.handoff.info(self.config.kv_role),
        }

    def _owner(self, session: str, key: str | None) -> str | None:
        """A DELETE's key may end ``session`` here (else 403); it goes down as is."""
        self.table.check_owner(session, key)
        return key

    def _end_here(self, session: str) -> bool:
        return self.seq.end_session(session)  # its waiters find it gone

    # ------------------------------------------------------------ upkeep

    async def maintain(self) -> None:
        """Forget idle sessions (TTL), waking anything that waits on them."""
        interval = min(self.limits.session_ttl / 4, _EXPIRY_INTERVAL)
        async with anyio.create_task_group() as tg:
            if self.downstream is not None:
                tg.start_soon(self.downstream.maintain)  # a replica set's probes, DNS
            while True:
                await anyio.sleep(interval)
                self._clock = loop_clock()  # this loop's, whatever a request left
                self.seq.expire()

    async def aclose(self) -> None:
        if self.downstream is not None:
            await self.downstream.aclose()

    def cancel_on_disconnect(self, event: EndpointRequest | ActivationReceived) -> bool:
        """A node finishes every request it took, even for a client that left."""
        return False


def _chunk_context(ticket: Ticket, headers: WireHeaders, deadline: float) -> StageContext:
    """What the stage is told of the chunk it runs; ``deadline`` on ``time.monotonic``."""
    return stage_context(
        ticket.session,
        ticket.position,
        ticket.tokens,
        ticket.index,
        headers.chunk_total or 1,
        ticket.run,
        deadline,
        headers.prefix,
        headers.prefix_blocks,
        headers.cache_salt,
        logit_rows(headers),
        ticket.rewind_from,
    )


def client_of(headers: WireHeaders, ctx: RequestContext) -> str | None:
    """Whom a session's quota counts (wire-2 §3.9, §3.15): the client the
    chain names (``X-Meshnet-Client``: every sender a node accepts holds
    the chain's token), else the sender's address."""
    return headers.client if headers.client is not None else ctx.peer
