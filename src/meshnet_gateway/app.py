"""The gateway's application: whole sequences in, chunked runs down the chain.

wire-2 §1 and the gateway paragraph of §3. A client POSTs one whole sequence
(wire 2, session/index/total optional); the gateway leases the client
session (``ClientSessionTable``), sends the sequence to the entry node as one
run of chunks (``_pipeline.run_chunks``), and answers one wire-2 response
whose ``X-Meshnet-Position`` is the offset of the sequence's first token.

If a chunk fails for good the nodes' contexts no longer match what the
client sent: the gateway answers the error at once, forgets the session and
deletes it down the chain in the background, so a hung node cannot delay
the answer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import numpy as np

from meshnet_proto import (
    ActivationHead,
    ActivationReceived,
    ClientSessionTable,
    EndpointRequest,
    ErrorCode,
    MeshnetError,
    ProtocolError,
    SequencingError,
    WireHeaders,
)
from meshnet_proto.lowlevel import ChainProblem, Lease, apply_wire_dtype
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.control import ControlEndpoints
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import Downstream, key_headers
from meshnet_runtime.http_server import ActivationReply, Reply, RequestContext, StreamReply
from meshnet_runtime.link import LinkEstimate
from meshnet_runtime.metrics import ServerMetrics
from meshnet_runtime.wire_encoder import WireEncoder

from ._pipeline import RunResult, run_chunks
from ._retry import RetryPolicy
from .access import AccessLog, AccessRecord, access_record
from .admission import Admission
from .chain import RECHECK_CODES, ChainCheck, ChainMismatch, gateway_facts
from .chain_view import ChainView
from .clients import GatewayClients
from .config import GatewayConfig
from .entry import EntryWindow, entry_downstream
from .forward_admission import admitted
from .info import gateway_info
from .openai import OpenAIService
from .openai.api import OPENAI_ROUTES
from .openai.direct_return import DirectReturn
from .openai.errors import from_meshnet
from .openai.timing import RequestTiming
from .openai_service import close_hops, openai_service

__all__ = ["ChainMismatch", "GatewayApp"]

log = logging.getLogger("meshnet.gateway")

# Background DELETEs down the chain after a failed chunk: bounded, so a hung
# node costs one waiting task for at most this long.
DELETE_TIMEOUT = 10.0


class GatewayApp:
    """Implements ``meshnet_runtime.http_server.Application`` for the gateway.

    Use inside ``async with app.running():`` — it owns the task group of
    the background session deletes and closes the downstream pool on exit.
    """

    def __init__(
        self,
        config: GatewayConfig,
        *,
        pool: Downstream | None = None,
        codecs: CodecPool | None = None,
        metrics: ServerMetrics | None = None,
    ) -> None:
        if config.entry is None:
            raise ValueError("the gateway needs an entry node (--entry)")
        self.config = config
        self.metrics = metrics or ServerMetrics("gateway")
        self.codecs = codecs or CodecPool(limits=config.limits, metrics=self.metrics)
        self.pool: Downstream = pool or entry_downstream(config, self.metrics)
        self.sessions = ClientSessionTable(
            config.max_sessions,
            config.session_ttl,
            max_per_client=config.limits.max_sessions_per_client,
        )
        self.retry = RetryPolicy(config.retries, config.retry_backoff_ms / 1000)
        # --encoding auto also weighs the link's speed: toward the entry node
        # (measured on its answers) and toward clients (measured on the
        # request bodies they upload; one estimate for all clients). Chunks
        # keep the run's dtype (chosen once per request); answers get --wire-dtype.
        self.to_entry, self.to_clients = _encoders(config, self.codecs, self.pool.link)
        # The gateway's own side of the chain check (its model's facts).
        self.facts = gateway_facts(config)
        # The entry node's reorder window (until its /info is read: one chunk at a time).
        self.entry = EntryWindow(self.pool, config.inflight)
        self._background: anyio.abc.TaskGroup | None = None
        # Sessions with a request in progress: checked on the head, before
        # the body is read (wire-2 §2 order: header-only sequencing first).
        self._active: set[str] = set()
        # --model: the OpenAI API (/v1) over the same chain, behind admission
        # control (issue 19): generations wait or are refused before any work.
        self.admission = Admission(
            max_running=config.max_running,
            max_prefill_tokens=config.max_prefill_tokens,
            max_queued=config.max_queued,
            queue_timeout=config.queue_timeout,
        )
        # Who may call (wire-2 §7) and whom each request serves (§3.15).
        self.clients = GatewayClients(config)
        # One line per request at info (meshnet.access; --no-access-log).
        self.access = AccessLog(enabled=not config.no_access_log)
        self.openai: OpenAIService | None = None
        self.direct: DirectReturn | None = None  # --direct-return (wire-2 §3.14)
        if config.model is not None:
            self.openai = openai_service(self)
        self.metrics.sessions.set_function(lambda: len(self.sessions))
        self.control = ControlEndpoints(
            role="gateway",
            metrics=self.metrics,
            downstream=self.pool,
            timeout=config.timeout,
            info=self.info,
            end_here=self._end_here,
            check_facts=self.check_facts,
            owner=self._owner,
        )
        # The chain check (wire-2 §6.2): while it lists problems, nothing is
        # sent down; ``fail_fast``: at start, problems end the process
        # (``ChainMismatch``) instead (meshnet-gateway).
        self.chain = ChainCheck(self.control, self.pool.url, config.health_interval)
        self.pool.on_change = self.chain.changed  # a replica set's changes (a node has none)
        self.control.readiness = self.chain.readiness  # /health?ready=1: the check's verdict
        # /info's "stages": the chain walked by each hop's /info (bounded).
        self.chain_view = ChainView(self.pool, token=config.token, tls_ca=config.tls_ca)

    # ------------------------------------------------------------ lifecycle

    @asynccontextmanager
    async def running(self) -> AsyncIterator[GatewayApp]:
        async with anyio.create_task_group() as tg:
            self._background = tg
            tg.start_soon(self.pool.maintain)  # health probes of the entry's replicas, if any
            tg.start_soon(self.clients.watch)  # --api-keys: re-read as the file changes
            self.chain.arm()
            try:
                if await self.entry.refresh(quiet=True) is None and not self.entry.read:
                    tg.start_soon(self.entry.read_at_start)
                await self.chain.start(tg)
                yield self
            finally:
                self._background = None
                # Pending deletes are best effort; the nodes' TTL ends the rest.
                tg.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    await close_hops(self)

    @property
    def inflight(self) -> int:
        """``--inflight`` capped at the entry node's reorder window (wire-2 §1)."""
        return self.entry.inflight

    @property
    def entry_window(self) -> int | None:
        """The entry node's reorder window, once known."""
        return self.entry.window

    @property
    def entry_info_read(self) -> bool:
        """Its /info answered (a window may still be absent)."""
        return self.entry.read

    async def refresh_entry_window(self, *, quiet: bool = False) -> int | None:
        """Read the entry node's reorder window now (see ``EntryWindow.refresh``)."""
        return await self.entry.refresh(quiet=quiet)

    # ------------------------------------------------------------ chain check

    def check_facts(self) -> dict[str, Any]:
        """What ``check_chain`` is told about the gateway (wire-2 §6.2)."""
        return {**self.facts, "inflight": self.config.inflight}

    async def check_chain(self, *, quiet: bool = False) -> list[ChainProblem] | None:
        """Walk the chain and check it now (see ``ChainCheck.check``)."""
        return await self.chain.check(quiet=quiet)

    @property
    def chain_problems(self) -> list[ChainProblem] | None:
        """What the last check found ([] = fine, None = not walked yet)."""
        return self.chain.problems

    @property
    def expected_entry(self) -> str | None:
        """The stage the entry must be (``"<model>/0"``), once the check saw it."""
        return self.chain.expected_entry

    @expected_entry.setter
    def expected_entry(self, stage: str | None) -> None:
        self.chain.expected_entry = stage

    @property
    def fail_fast(self) -> bool:
        """Problems found at start end the process (``ChainMismatch``)."""
        return self.chain.fail_fast

    @fail_fast.setter
    def fail_fast(self, on: bool) -> None:
        self.chain.fail_fast = on

    # ------------------------------------------------------------ /forward

    async def handle_activation_head(self, event: ActivationHead, ctx: RequestContext) -> None:
        # Refused now, before the body: its line too.
        await self.access.around(
            access_record("POST", "/forward", event.query, ctx),
            lambda: self._check_activation_head(event),
            answered=False,
        )

    async def _check_activation_head(self, event: ActivationHead) -> None:
        # Reject before reading what may be hundreds of MiB of body.
        if event.kv_import:  # wire-2 §3.11: a node's; a gateway holds no stage's KV
            raise ProtocolError(
                "a gateway imports no KV (it is a node's route)",
                code=ErrorCode.BAD_KV,
                header="x-meshnet-kv-checksum",
            )
        self.chain.refuse_if_mismatched()
        session = event.headers.session
        if session is not None:
            self.sessions.check_owner(session, event.headers.session_key)  # 403, wire-2 §3.9
            if self._busy(session):
                raise _session_busy(session)
        tokens = event.headers.tokens
        total = -(-tokens // self.config.chunk_tokens)
        if total > self.config.limits.max_chunk_total:
            raise ProtocolError(
                f"{tokens} tokens make {total} chunks of {self.config.chunk_tokens}, over the "
                f"limit of {self.config.limits.max_chunk_total} chunks per run",
                code=ErrorCode.TENSOR_TOO_LARGE,
                header="x-meshnet-shape",
            )

    async def handle_activation(
        self, event: ActivationReceived, ctx: RequestContext
    ) -> ActivationReply:
        record = access_record("POST", "/forward", event.query, ctx)
        return await self.access.around(record, lambda: self._forward(event, ctx))

    async def _forward(self, event: ActivationReceived, ctx: RequestContext) -> ActivationReply:
        request = event.headers
        deadline = Deadline.start(ctx.started, self.config.timeout, request.deadline_ms)
        deadline.check()
        if self.to_clients.auto is not None:
            # Head to decoded body: the upload, plus a decode that only errs
            # toward a slower link (zstd), never toward a faster one.
            nbytes = event.body_nbytes
            self.to_clients.auto.link.observe(nbytes, nbytes, anyio.current_time() - ctx.started)
        self.entry.refresh_soon(self._background)  # until the entry's /info is read
        now = anyio.current_time()
        self.sessions.expire(now)
        lease = self.sessions.begin(
            request.session,
            now,
            entropy=os.urandom(16),
            key=request.session_key,
            client=ctx.client,  # the tenant's quota, or the address's (wire-2 §3.15)
        )
        self._active.add(lease.session)
        sent = False  # once a chunk may have gone down, a failure ends the session
        try:
            if request.position is not None and request.position != lease.position:
                raise SequencingError(
                    f"session {lease.session} is at position {lease.position} at this "
                    f"gateway, the request says {request.position}",
                    code=ErrorCode.POSITION_MISMATCH,
                    header="x-meshnet-position",
                )
            # One wire dtype for the whole run (wire-2 §3: a run keeps its dtype).
            tensor = await self.codecs.run(
                event.tensor.nbytes, apply_wire_dtype, event.tensor, self.config.wire_dtype
            )
            async with admitted(self.admission, request.tokens, ctx.client, deadline):
                sent = True
                result = await _run_forward(self, tensor, lease, request, deadline, ctx)
            dtype, encoding, body = await self.to_clients.encode(result.output, request.encoding)
        except BaseException as exc:
            if sent:
                self._fail(lease, exc)
            else:
                lease.commit(0)  # nothing went down the chain: the session is intact
            raise
        else:
            lease.commit(request.tokens, anyio.current_time())
        finally:
            self._active.discard(lease.session)
        self.metrics.chunks.labels("ok").inc(len(result.chunks))
        return ActivationReply(_response_headers(result.output, dtype, encoding, lease), body)

    def on_chain_suspect(self) -> None:
        """A node answered that it is not the stage expected (409
        ``stage_mismatch``) or lost a session (``session_unknown``): the chain
        may have changed since it was checked, so it is checked again before
        anything more is sent (wire-2 §6.2). The one place both the wire-2
        path (``_fail``) and the OpenAI path ask for it."""
        self.chain.changed()

    def cancel_on_disconnect(self, event: EndpointRequest | ActivationReceived) -> bool:
        """The serving loop cancels these requests when their client leaves:
        a generation nobody waits for would hold every node's KV to the end,
        and a wire-2 run would go on computing on every node (wire-2 §3.7);
        cancelled, the run ends as a failed one: forgotten, DELETEd below."""
        if isinstance(event, ActivationReceived):
            return True
        return self.openai is not None and event.path.startswith("/v1/")

    def _spawn(self, fn: Any, *args: Any) -> None:
        """A background task outliving its request (the OpenAI surface's
        reclaim of a stream's ticket); outside ``running()``, none is started."""
        if self._background is not None:
            self._background.start_soon(fn, *args)

    def _count_retry(self, index: int, error: MeshnetError) -> None:
        self.metrics.chunks.labels("retried").inc()

    def _busy(self, session: str) -> bool:
        return session in self._active

    def _fail(self, lease: Lease, exc: BaseException) -> None:
        """A chunk failed for good (or the request was cancelled mid-run)."""
        lease.abort()
        self.metrics.chunks.labels("failed").inc()
        if isinstance(exc, MeshnetError):
            log.info(
                "session %s: %s %s (hop %s); deleting it down the chain",
                lease.session,
                exc.status,
                exc.code,
                exc.hop,
            )
            if exc.code in RECHECK_CODES:
                self.on_chain_suspect()  # a stage changed since the chain was checked
        if self._background is not None:
            self._background.start_soon(self._delete_down_chain, lease.session, lease.node_key)

    async def _delete_down_chain(self, session: str, key: str | None) -> None:
        try:
            response = await self.pool.request(
                "DELETE", f"/sessions/{session}", Deadline.after(DELETE_TIMEOUT), key_headers(key)
            )
            status = response.status
        except MeshnetError as exc:
            log.warning("DELETE /sessions/%s at %s failed: %s", session, self.pool.url, exc)
            return
        log.debug("DELETE /sessions/%s at %s: %d", session, self.pool.url, status)

    # ------------------------------------------------------------ endpoints

    async def handle_endpoint(
        self, event: EndpointRequest, ctx: RequestContext
    ) -> Reply | StreamReply:
        record = access_record(event.method, event.path, event.query, ctx)
        return await self.access.around(record, lambda: self._endpoint(event, ctx, record))

    async def _endpoint(
        self, event: EndpointRequest, ctx: RequestContext, record: AccessRecord
    ) -> Reply | StreamReply:
        if self.openai is not None and event.route in OPENAI_ROUTES:
            try:
                self.chain.refuse_if_mismatched()
            except MeshnetError as exc:
                return from_meshnet(exc).reply()
            record.timing = RequestTiming(arrived=ctx.started)
            return await self.openai.handle(event, record.timing, tenancy=self.clients.tenancy(ctx))
        if event.route == "/info":
            return Reply.json(200, await self.describe())
        reply = await self.control.handle(event, ctx)
        assert isinstance(reply, Reply)  # a gateway exports no KV: /kv/* is its 404
        return reply

    def _owner(self, session: str, key: str | None) -> str | None:
        """A client's DELETE must carry the session's key (403); what goes down
        the chain is the nodes' key, never the client's (wire-2 §3.9)."""
        self.sessions.check_owner(session, key)
        node_key = self.sessions.node_key(session)
        return key if node_key is None else node_key

    def _end_here(self, session: str) -> bool:
        """A client's DELETE: forget the session here (409 while a request runs on it)."""
        if self._busy(session):
            raise _session_busy(session)
        return self.sessions.end(session)

    def info(self) -> dict[str, Any]:
        """The gateway's own part of ``/info`` (what it knows without asking)."""
        return gateway_info(self)

    async def describe(self) -> dict[str, Any]:
        """``GET /info``: ``info()`` and the chain in one view (``stages``, ``walk``)."""
        return {**self.info(), **await self.chain_view.describe()}


def _encoders(
    config: GatewayConfig, codecs: CodecPool, entry_link: LinkEstimate
) -> tuple[WireEncoder, WireEncoder]:
    """The encoder toward the entry node and the one toward clients."""
    level = config.zstd_level
    to_entry = WireEncoder(codecs, encoding=config.encoding, level=level, link=entry_link)
    to_clients = WireEncoder(
        codecs,
        dtype_policy=config.wire_dtype,
        encoding=config.encoding,
        level=level,
        link=LinkEstimate(),
    )
    return to_entry, to_clients


def _response_headers(output: np.ndarray, dtype: str, encoding: str, lease: Lease) -> WireHeaders:
    # The whole sequence is one chunk of one run at the gateway's interface,
    # so the answer carries index 0 of 1: every wire-2 reader accepts it.
    # A key the gateway minted is told to the client once, here (wire-2 §3.9).
    return WireHeaders(
        shape=tuple(output.shape),
        dtype=dtype,
        session=lease.session,
        chunk_index=0,
        chunk_total=1,
        encoding=encoding,
        position=lease.position,
        session_key=lease.key if lease.key_minted else None,
    )


def _session_busy(session: str) -> SequencingError:
    return SequencingError(
        f"session {session} already has a request in progress at this gateway",
        code=ErrorCode.SESSION_BUSY,
        header="x-meshnet-session",
    )


async def _run_forward(
    app: GatewayApp,
    tensor: np.ndarray,
    lease: Lease,
    request: WireHeaders,
    deadline: Deadline,
    ctx: RequestContext,
) -> RunResult:
    """A ``/forward`` sequence down the chain as one run of chunks; a new
    session's first run says whom it serves (wire-2 §3.15: the nodes read it
    when the session starts, so a continuation, a decode step, carries none)."""
    mark = app.clients.tenancy(ctx).mark if lease.position == 0 else None
    return await run_chunks(
        app.pool,
        app.to_entry,
        tensor,
        session=lease.session,
        session_key=lease.node_key,
        base_position=lease.position,
        chunk_tokens=app.config.chunk_tokens,
        inflight=app.inflight,
        request_encoding=request.encoding,
        deadline=deadline,
        retry=app.retry,
        on_retry=app._count_retry,
        stage=app.expected_entry,
        annotate=mark,
    )
