"""Running a node: its application and server built from a config, and a
node served in this process (tests, ``meshnet demo``, ``meshnet run``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import anyio

from meshnet_proto.lowlevel import ByteBudget, request_cost
from meshnet_runtime.http_server import DrainHandoff, HttpServer
from meshnet_runtime.lifecycle import server_settings, server_tls
from meshnet_runtime.metrics import ServerMetrics
from meshnet_runtime.transports import listen

from .app import NodeApp
from .backends import StageBackend
from .config import NodeConfig
from .model_stage import stage_from_config

__all__ = ["RunningNode", "build_node", "serve_node"]


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
    budget = ByteBudget(app.limits.max_inflight_bytes, retry_after=settings.retry_after)
    app.handoff.inflight = budget  # a KV export's copy is held by a request in flight
    server = HttpServer(
        app,
        app.make_connection,
        settings=settings,
        metrics=metrics,
        ssl_context=ssl_context,
        codecs=app.codecs,
        budget=budget,
        cost=partial(request_cost, relaying=app.downstream is not None),
        handoff=DrainHandoff(config.handoff_window, app.handoff.held)
        if app.handoff.store is not None and config.handoff_window > 0
        else None,
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
