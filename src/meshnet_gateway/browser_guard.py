"""The gateway's application as a browser meets it (``meshnet_gateway.browser``
says why): ``OPTIONS`` preflights answered, the OpenAI POST bodies JSON
only, and the CORS headers on every answer to an allowed ``Origin``.

`BrowserGuard` wraps `GatewayApp` for the serving loop; the Host and Origin
checks themselves run earlier, in the wire-2 core (`BrowserPolicy.check_head`),
so what reaches here comes from a name and an origin the gateway serves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from meshnet_proto import ActivationHead, ActivationReceived, EndpointRequest
from meshnet_runtime.application import ActivationReply, Reply, RequestContext, StreamReply

from .access import access_record
from .browser import BrowserPolicy, cors_headers, header_values, is_json, preflight_headers
from .openai.errors import OpenAIError
from .openai.unknown import UNKNOWN_ROUTE

if TYPE_CHECKING:
    from .app import GatewayApp

__all__ = ["BrowserGuard"]


class BrowserGuard:
    """Implements ``meshnet_runtime.http_server.Application`` around ``app``.

    ``routes``: the route table the core serves (its methods say what a
    preflight may ask for); ``OPTIONS`` on any of them is answered here.
    """

    def __init__(
        self, app: GatewayApp, policy: BrowserPolicy, routes: Mapping[str, Collection[str]]
    ) -> None:
        self.app = app
        self.policy = policy
        self.routes = routes
        # The OpenAI POST endpoints: where a body is a request to generate
        # (an unknown /v1 path is a 404 whatever its body).
        self.json_routes = frozenset(
            pattern
            for pattern, methods in routes.items()
            if pattern.startswith("/v1/") and "POST" in methods and pattern != UNKNOWN_ROUTE
        )

    async def handle_activation_head(self, event: ActivationHead, ctx: RequestContext) -> None:
        await self.app.handle_activation_head(event, ctx)

    async def handle_activation(
        self, event: ActivationReceived, ctx: RequestContext
    ) -> ActivationReply:
        # /forward answers wire 2 (binary, X-Meshnet-* headers): not for
        # pages, so no CORS (its preflight is the core's 405).
        return await self.app.handle_activation(event, ctx)

    def cancel_on_disconnect(self, event: EndpointRequest | ActivationReceived) -> bool:
        return self.app.cancel_on_disconnect(event)

    async def handle_endpoint(
        self, event: EndpointRequest, ctx: RequestContext
    ) -> Reply | StreamReply:
        origin = self.policy.cors_origin(event.headers)
        early = self._answer_here(event, origin)
        if early is not None:

            async def answered() -> Reply:
                return early

            record = access_record(event.method, event.path, event.query, ctx)
            return await self.app.access.around(record, answered)
        reply = await self.app.handle_endpoint(event, ctx)
        if origin is None:
            return reply
        return dataclasses.replace(reply, headers=[*reply.headers, *cors_headers(origin)])

    def _answer_here(self, event: EndpointRequest, origin: str | None) -> Reply | None:
        """A preflight's answer, or a non-JSON generation request's 415; None
        for the gateway to answer."""
        if event.method == "OPTIONS":
            methods = [m for m in self.routes.get(event.route, ()) if m != "OPTIONS"]
            requested = header_values(event.headers, b"access-control-request-headers")
            asked = ",".join(requested) if requested else None
            return Reply(204, preflight_headers(origin, methods, asked))
        if event.route in self.json_routes and event.method == "POST":
            content_types = header_values(event.headers, b"content-type")
            if not is_json(content_types):
                shown = ", ".join(content_types)[:100] or "none"
                refusal = OpenAIError(
                    f"the body must be JSON (Content-Type: application/json), not {shown}; "
                    "with curl, add -H 'Content-Type: application/json'",
                    status=415,
                    code="unsupported_media_type",
                ).reply()
                if origin is None:
                    return refusal
                return Reply(415, [*refusal.headers, *cors_headers(origin)], refusal.body)
        return None
