"""Wiring a gateway: config → application → HTTP server, in a process or in-process.

``__main__`` serves until a signal; ``open_gateway`` serves inside an
``async with`` block, which is how ``meshnet demo`` and the tests run a
gateway next to its nodes in one process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio

from meshnet_proto import ServerConnection, WireHeaders
from meshnet_proto.lowlevel import (
    DEFAULT_MAX_ENDPOINT_BODY,
    DEFAULT_ROUTES,
    ByteBudget,
    request_cost,
)
from meshnet_runtime.http_server import HttpServer
from meshnet_runtime.lifecycle import rss_suffix, server_settings, server_tls
from meshnet_runtime.transports import BoundListener

from .app import GatewayApp
from .browser import BrowserPolicy, with_preflight
from .browser_guard import BrowserGuard
from .config import GatewayConfig
from .openai.api import MAX_REQUEST_BODY as OPENAI_MAX_REQUEST_BODY
from .openai.api import OPENAI_ROUTES

__all__ = ["RunningGateway", "build_server", "open_gateway", "ready_line"]


def build_server(config: GatewayConfig, app: GatewayApp) -> HttpServer:
    limits = config.limits

    routes: dict[str, Any] = dict(DEFAULT_ROUTES)
    max_endpoint_body = DEFAULT_MAX_ENDPOINT_BODY
    if app.openai is not None:
        routes.update(with_preflight(OPENAI_ROUTES))  # browsers' preflights (browser_guard)
        max_endpoint_body = OPENAI_MAX_REQUEST_BODY
    # Host and Origin checked on every head, before credentials (browser.py).
    browsers = BrowserPolicy.build(config.host, config.allowed_hosts, config.allowed_origins)

    def make_connection() -> ServerConnection:
        # The gateway's input is a whole sequence: session, index and total
        # are optional there (wire-2 §2).
        return ServerConnection(
            limits=limits,
            credentials=app.clients.credentials,  # the chain's token and clients' API keys
            require_sequencing=False,
            routes=routes,
            max_endpoint_body=max_endpoint_body,
            head_check=browsers.check_head,
        )

    settings = server_settings(config)
    ssl_context = server_tls(config)
    return HttpServer(
        BrowserGuard(app, browsers, routes),
        make_connection,
        settings=settings,
        metrics=app.metrics,
        ssl_context=ssl_context,
        codecs=app.codecs,
        budget=ByteBudget(limits.max_inflight_bytes, retry_after=settings.retry_after),
        cost=_gateway_cost,
        # Shutdown ends open OpenAI streams with a final event (docs/gateway.md).
        on_drain=app.openai.end_streams_by if app.openai is not None else None,
    )


def _gateway_cost(headers: WireHeaders) -> int:
    # Beside the request (body and tensor) the gateway holds the reassembled
    # output, as large as the input: the chain's stages keep shapes.
    return request_cost(headers) + headers.nbytes


def ready_line(url: str, app: GatewayApp) -> str:
    """The one line a started gateway prints (wire-2 §9); the URL comes first
    after ``listening on`` so scripts can cut it out, the resident memory last."""
    config = app.config
    window = app.entry_window if app.entry_info_read else "unknown"
    return (
        f"meshnet-gateway listening on {url} (entry {app.pool.url}, "
        f"chunk-tokens {config.chunk_tokens}, inflight {app.inflight} "
        f"[asked {config.inflight}, entry window {window}])"
        + (f"; OpenAI API at {url}/v1 for {app.openai.model.name}" if app.openai else "")
        + rss_suffix()
    )


@dataclass(frozen=True, slots=True)
class RunningGateway:
    url: str
    app: GatewayApp
    server: HttpServer


@asynccontextmanager
async def open_gateway(
    config: GatewayConfig, bound: BoundListener | None = None
) -> AsyncIterator[RunningGateway]:
    """Serve a gateway for the duration of the block; graceful shutdown on exit.

    ``bound``: a listener bound beforehand (``meshnet run`` binds its port
    before loading any model, so a taken port costs no load); else bound here.
    """
    from meshnet_runtime.transports import listen

    app = GatewayApp(config)
    async with app.running():
        if bound is None:
            bound = await listen(host=config.host, port=config.port, uds=config.uds, tls=config.tls)
        server = build_server(config, app)
        async with anyio.create_task_group() as tg:
            url = await tg.start(server.serve, bound)
            try:
                yield RunningGateway(url, app, server)
            finally:
                server.request_shutdown()
