"""The control endpoints of every server, one behaviour (wire-2 §6).

``GET /health`` (``?deep=1`` asks the downstream too), ``GET /info``,
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

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from meshnet_proto import (
    DEFAULT_ROUTES,
    DownstreamError,
    EndpointRequest,
    ErrorResponse,
    MeshnetError,
    ProtocolError,
    parse_session_key,
)

from .deadlines import Deadline
from .downstream import DownstreamPool, key_headers
from .http_server import Reply, RequestContext
from .metrics import METRICS_CONTENT_TYPE, ServerMetrics

__all__ = ["HEALTH_TIMEOUT", "ControlEndpoints"]

log = logging.getLogger("meshnet.control")

# A deep health check waits at most this long for the downstream's answer
# (or the server's --timeout when shorter): a probe must not hang.
HEALTH_TIMEOUT = 10.0

Handler = Callable[[EndpointRequest, RequestContext], Awaitable[Reply]]


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
        downstream: DownstreamPool | Any | None,  # or a replicas.ReplicaSet
        timeout: float,
        info: Callable[[], dict[str, Any]],
        end_here: Callable[[str], bool],
        owner: Callable[[str, str | None], str | None] | None = None,
    ) -> None:
        self.role = role
        self.metrics = metrics
        self.downstream = downstream
        self.timeout = timeout
        self.info = info
        self.end_here = end_here
        self.owner = owner
        self.handlers: dict[str, Handler] = {
            "/health": self.health,
            "/info": self.describe,
            "/metrics": self.render_metrics,
            "/sessions/*": self.delete_session,
        }
        assert self.handlers.keys() == DEFAULT_ROUTES.keys()

    async def handle(self, event: EndpointRequest, ctx: RequestContext) -> Reply:
        return await self.handlers[event.route](event, ctx)

    async def health(self, event: EndpointRequest, ctx: RequestContext) -> Reply:
        document: dict[str, Any] = {"status": "ok", "role": self.role}
        deep = parse_qs(event.query).get("deep", ["0"])[-1] in ("1", "true")
        pool = self.downstream
        deep_health = getattr(pool, "deep_health", None)
        if deep and deep_health is not None:  # a replica set: each replica's own answer
            deadline = Deadline.start(ctx.started, min(self.timeout, HEALTH_TIMEOUT), None)
            below = await deep_health(deadline)
            document["downstream"] = below
            if below["status"] != "ok":
                document["status"] = "degraded"
        elif deep and pool is not None:
            deadline = Deadline.start(ctx.started, min(self.timeout, HEALTH_TIMEOUT), None)
            response = await pool.request("GET", "/health?deep=1", deadline)
            if isinstance(response, ErrorResponse):
                raise response.to_error(hop=pool.url)
            try:
                below = document["downstream"] = json.loads(response.body)
                if isinstance(below, dict) and below.get("status") == "degraded":
                    document["status"] = "degraded"  # some replica below is down
            except ValueError:
                raise DownstreamError(
                    f"{pool.url}: /health is not JSON",
                    code="downstream_bad_response",
                    hop=pool.url,
                ) from None
        return Reply.json(200, document)

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
        if pool is not None:
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
            raise ProtocolError(f"session {session} is unknown", code="not_found", status=404)
        return Reply(204)
