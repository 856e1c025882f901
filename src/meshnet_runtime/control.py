"""The control endpoints of every server, one behaviour (wire-2 §6).

``GET /health`` (``?deep=1`` asks the downstream too, ``?ready=1`` says
whether this server can serve now), ``GET /info``,
``GET /metrics`` and ``DELETE /sessions/{id}`` mean the same on a node and
on a gateway; only what the server *is* differs, and the application says
that: its role, its ``/info`` document, and what ending a session here
means. Passing a question down the chain (deep health, DELETE) is here,
once.

Routing is the core's: ``ServerConnection`` matched the path against its
route table and answered 404/405 itself; ``EndpointRequest.route`` says
which entry matched, and that is the key of :attr:`ControlEndpoints.handlers`.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import anyio

from meshnet_proto import (
    CapacityError,
    DownstreamError,
    EndpointRequest,
    ErrorCode,
    ErrorResponse,
    MeshnetError,
    ProtocolError,
    chain_from_health,
    check_chain,
)
from meshnet_proto.lowlevel import (
    DEFAULT_ROUTES,
    ChainProblem,
    StageReport,
    is_deep_health,
    parse_session_key,
)

from .deadlines import Deadline
from .downstream import Downstream, key_headers
from .http_server import ActivationReply, Reply, RequestContext
from .metrics import METRICS_CONTENT_TYPE, ServerMetrics

__all__ = ["HEALTH_CACHE", "HEALTH_TIMEOUT", "ControlEndpoints", "is_ready_query", "not_ready"]

log = logging.getLogger("meshnet.control")

# A deep health check waits at most this long for the downstream's answer
# (or the server's --timeout when shorter): a probe must not hang.
HEALTH_TIMEOUT = 10.0
# Deep health answers are this fresh at most (wire-2 §6.2): a burst of
# callers costs the chain below one walk.
HEALTH_CACHE = 2.0

# This process's own random id in every /health answer: a hop's probes
# tell a restart (perhaps as another stage) from a replica that stayed up,
# however quickly it came back on its port (wire-2 §6.2).
INSTANCE = secrets.token_hex(8)

Handler = Callable[[EndpointRequest, RequestContext], Awaitable[Reply | ActivationReply]]
# Raises ``not_ready(...)`` unless the server can serve now (``GET /health?ready=1``).
Readiness = Callable[[float], Awaitable[None]]


def is_ready_query(query: str) -> bool:
    """Whether a ``/health`` query asks for readiness (``ready=1``/``true``)."""
    return parse_qs(query).get("ready", ["0"])[-1] in ("1", "true")


def not_ready(role: str, why: str) -> CapacityError:
    """A readiness probe's refusal: 503 ``chain_mismatch``. ``why`` names
    problem codes only: ``?ready=1`` needs no token (an orchestrator's probe
    carries none), so the answer shows no URL and no identity (wire-2 §7);
    ``/health?deep=1`` with the token says where."""
    return CapacityError(
        f"this {role} cannot serve now: {why} (GET /health?deep=1 with the chain's token "
        "says where)",
        code=ErrorCode.CHAIN_MISMATCH,
        retry_after=1,
    )


class ControlEndpoints:
    """The handlers of ``DEFAULT_ROUTES``, by route.

    ``end_here(session)`` forgets a session at this server and says whether
    it knew it (it may raise, e.g. 409 while the session is busy).
    ``owner(session, key)`` raises 403 unless the DELETE's session key may
    end the session here, and returns the key to pass down (wire-2 §3.9).
    """

    def __init__(
        self,
        *,
        role: str,
        metrics: ServerMetrics,
        downstream: Downstream | None,
        timeout: float,
        info: Callable[[], dict[str, Any]],
        end_here: Callable[[str], bool],
        identity: dict[str, Any] | None = None,
        reorder_window: int | None = None,
        check_facts: Callable[[], dict[str, Any]] | None = None,
        health_cache: float = HEALTH_CACHE,
        owner: Callable[[str, str | None], str | None] | None = None,
        export_kv: Callable[[EndpointRequest, RequestContext], Awaitable[ActivationReply]]
        | None = None,
        drawn: Callable[[EndpointRequest, RequestContext], Awaitable[ActivationReply]]
        | None = None,
        readiness: Readiness | None = None,
    ) -> None:
        self.role = role
        self.metrics = metrics
        self.downstream = downstream
        self.timeout = timeout
        self.info = info
        self.end_here = end_here
        # A node's own part of its deep health (wire-2 §6.2); None at a gateway.
        self.identity = identity
        self.reorder_window = reorder_window
        # What check_chain is told about the sender into this level's chain:
        # a node sends on what its own window lets in; a gateway knows more.
        self.check_facts = check_facts or (lambda: {"inflight": reorder_window or 1})
        self.health_cache = health_cache
        self._health_cache: tuple[float, int, dict[str, Any] | MeshnetError] | None = None
        self._health_walk: tuple[anyio.Event, int] | None = None
        # What the last walk that got an answer found (the gateway reads them).
        self.hops: list[list[StageReport]] = []
        self.problems: list[ChainProblem] | None = None
        self.owner = owner
        # ``GET /health?ready=1``: a node asks the chain below (its deep
        # health, cached); a gateway sets its chain check's verdict here.
        self.readiness: Readiness = readiness or self.chain_below_serves
        self.handlers: dict[str, Handler] = {
            "/health": self.health,
            "/info": self.describe,
            "/metrics": self.render_metrics,
            "/sessions/*": self.delete_session,
            "/kv/*": export_kv or self.no_kv,
            "/drawn/*": drawn or self.no_drawn,
        }
        assert self.handlers.keys() == DEFAULT_ROUTES.keys()

    async def handle(self, event: EndpointRequest, ctx: RequestContext) -> Reply | ActivationReply:
        return await self.handlers[event.route](event, ctx)

    async def no_kv(self, event: EndpointRequest, ctx: RequestContext) -> Reply:
        """A server without sessions' KV (a gateway): wire-2 §6, 404."""
        raise ProtocolError(
            f"{event.path}: a {self.role} holds no session's KV (GET /kv/{{id}} is a node's)",
            code=ErrorCode.NOT_FOUND,
        )

    async def no_drawn(self, event: EndpointRequest, ctx: RequestContext) -> Reply:
        """A server that draws no tokens (a gateway): wire-2 §3.14, 404."""
        raise ProtocolError(
            f"{event.path}: a {self.role} draws no tokens (GET /drawn/{{id}} is a last stage's)",
            code=ErrorCode.NOT_FOUND,
        )

    async def health(self, event: EndpointRequest, ctx: RequestContext) -> Reply:
        if is_deep_health(event.query):
            return Reply.json(200, await self.deep_health(ctx.started))
        if is_ready_query(event.query):
            await self.readiness(ctx.started)
        # Answered at all: the process's loop runs, and a node listens only
        # once its model is loaded and its identity computed.
        return Reply.json(200, {"status": "ok", "role": self.role, "instance": INSTANCE})

    async def chain_below_serves(self, started: float) -> None:
        """Readiness by the chain check of the hops below (the deep health,
        from its cache): a hop whose chain below cannot serve is not ready.
        A replica down below, with another up, is ``degraded``: ready."""
        try:
            document = await self.deep_health(started)
        except MeshnetError as exc:  # no replica below answered, or garbage
            raise not_ready(self.role, exc.code) from None
        if document.get("status") == "cannot_serve":
            codes = sorted({str(p.get("code")) for p in document.get("problems", [])})
            raise not_ready(self.role, ", ".join(codes) or "cannot_serve")

    async def deep_health(self, started: float) -> dict[str, Any]:
        """The deep health document (wire-2 §6.2), from a short cache.

        One walk at a time: concurrent callers wait for the walk in flight
        and share its answer (a 502 too), so N calls cost each hop below one
        request, not N. The cache ends early when the replica set below
        changes (a replica down, back, taken out), and a walk that started
        before such a change is not joined.
        """
        while True:
            version = self.downstream.version if self.downstream is not None else 0
            cached = self._health_cache
            now = anyio.current_time()
            if cached is not None and cached[0] > now and cached[1] == version:
                return _outcome(cached[2])
            walking = self._health_walk
            if walking is None or walking[1] != version:
                # None in flight, or one that started before the replicas
                # below changed (it may be waiting on one now known down).
                break
            await walking[0].wait()
        done = anyio.Event()
        self._health_walk = (done, version)
        outcome: dict[str, Any] | MeshnetError | None = None
        try:
            try:
                outcome = await self.walk(started)
            except MeshnetError as exc:
                outcome = exc
            self._health_cache = (anyio.current_time() + self.health_cache, version, outcome)
        finally:
            # Cancelled (its caller left): the waiters find no answer and walk themselves.
            if self._health_walk is not None and self._health_walk[0] is done:
                self._health_walk = None
            done.set()
        return _outcome(outcome)

    async def walk(self, started: float) -> dict[str, Any]:
        """One walk of the chain below, uncached: the deep health document;
        ``hops`` and ``problems`` keep what it found."""
        document: dict[str, Any] = {"status": "ok", "role": self.role}
        if self.identity is not None:
            document["identity"] = self.identity
            document["reorder_window"] = self.reorder_window
        pool = self.downstream
        deadline = Deadline.start(started, min(self.timeout, HEALTH_TIMEOUT), None)
        below: Any = None
        if pool is not None:  # a replica set: each replica's own answer; a node: its own
            document.update(await pool.deep_health(deadline))
            below = document.get("downstream")
        if pool is not None:
            try:
                hops = chain_from_health(document)
                if self.identity is None:
                    hops = hops[1:]  # a gateway: the chain starts at its entry
                problems = check_chain(hops, **self.check_facts())
            except ValueError as exc:
                raise _bad_health(pool.url, f"is not a wire-2 §6.2 document: {exc}") from None
            self.hops, self.problems = hops, problems
            document["problems"] = [p.to_json() for p in problems]
            if problems:
                document["status"] = "cannot_serve"
            elif isinstance(below, dict) and below.get("status") != "ok":
                document["status"] = "degraded"  # some replica below is down
        elif self.identity is not None:
            document["problems"] = []
        return document

    async def describe(self, event: EndpointRequest, ctx: RequestContext) -> Reply:
        return Reply.json(200, self.info())

    async def render_metrics(self, event: EndpointRequest, ctx: RequestContext) -> Reply:
        headers = [(b"content-type", METRICS_CONTENT_TYPE.encode())]
        return Reply(200, headers, self.metrics.render())

    async def delete_session(self, event: EndpointRequest, ctx: RequestContext) -> Reply:
        """End the session here and down the chain (wire-2 §3).

        204 when this server or any below knew it, 404 when none did. A
        downstream failure is reported only when this server did not know
        the session (else the chain's state is already what the caller
        wanted here; the nodes' TTL ends the rest).
        """
        session = event.path.removeprefix("/sessions/")
        key = parse_session_key(event.headers)
        if self.owner is not None:
            key = self.owner(session, key)
        known = self.end_here(session)
        pool = self.downstream
        # ``?replay=1``: a hop about to rebuild this node's copy by replay
        # ends it here only — the stages below hold their own state, as a
        # replayed chunk is not forwarded either (wire-2 §3.8).
        if pool is not None and not event.replay:
            deadline = Deadline.start(ctx.started, self.timeout, None)
            try:
                response = await pool.request(
                    "DELETE", f"/sessions/{session}", deadline, key_headers(key)
                )
            except MeshnetError:
                if not known:
                    raise
                log.warning("could not pass DELETE /sessions/%s down", session, exc_info=True)
            else:
                if response.status == 204:
                    known = True
                elif isinstance(response, ErrorResponse) and response.status != 404 and not known:
                    raise response.to_error(hop=pool.url)
        if not known:
            raise ProtocolError(f"session {session} is unknown", code=ErrorCode.NOT_FOUND)
        return Reply(204)


def _outcome(outcome: dict[str, Any] | MeshnetError | None) -> dict[str, Any]:
    if outcome is None:  # the walk we waited for was cancelled
        raise DownstreamError("the health walk was cancelled", code=ErrorCode.DOWNSTREAM_TIMEOUT)
    if isinstance(outcome, MeshnetError):
        raise outcome
    return outcome


def _bad_health(url: str, what: str) -> DownstreamError:
    return DownstreamError(
        f"{url}: /health {what}", code=ErrorCode.DOWNSTREAM_BAD_RESPONSE, hop=url
    )
