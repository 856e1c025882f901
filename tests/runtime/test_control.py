"""/health, /info, /metrics and DELETE /sessions/{id}: one behaviour on node and gateway.

Both servers run the same handlers (``meshnet_runtime.control``); each test
runs against both, pointed at the same downstream, and expects the same.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from meshnet_gateway import open_gateway
from meshnet_gateway.config import GatewayConfig
from meshnet_node import serve_node
from meshnet_node.config import NodeConfig
from meshnet_proto import ServerConnection
from meshnet_proto._server import DEFAULT_ROUTES
from meshnet_runtime.control import ControlEndpoints
from meshnet_runtime.http_server import HttpServer, Reply, RequestContext
from meshnet_runtime.metrics import ServerMetrics
from meshnet_runtime.transports import listen
from support.wire import exchange, http_request

pytestmark = pytest.mark.anyio

QUIET = ["--host", "127.0.0.1", "--port", "0", "--log-level", "warning"]


class _OddDownstream:
    """A downstream whose /health is not JSON and which knows no session."""

    async def handle_activation_head(self, event: Any, ctx: RequestContext) -> None:
        raise AssertionError("no activations here")

    async def handle_activation(self, event: Any, ctx: RequestContext) -> Reply:
        raise AssertionError("no activations here")

    async def handle_endpoint(self, event: Any, ctx: RequestContext) -> Reply:
        if event.route == "/health":
            return Reply(200, [(b"content-type", b"text/plain")], b"fine, thanks")
        if event.route == "/info":
            return Reply.json(200, {"reorder_window": 4})
        return Reply.json(404, {"error": {"code": "not_found", "message": "unknown"}})

    def cancel_on_disconnect(self, event: Any) -> bool:
        return False


@asynccontextmanager
async def odd_downstream() -> AsyncIterator[str]:
    server = HttpServer(_OddDownstream(), ServerConnection)
    bound = await listen(host="127.0.0.1", port=0)
    async with anyio.create_task_group() as tg:
        url = await tg.start(server.serve, bound)
        yield url
        server.request_shutdown()


@asynccontextmanager
async def server_over(role: str, downstream: str) -> AsyncIterator[str]:
    if role == "node":
        async with serve_node(NodeConfig.load([*QUIET, "--next", downstream])) as node:
            yield node.url
    else:
        config = GatewayConfig.load([*QUIET, "--entry", downstream])
        async with open_gateway(config) as gateway:
            yield gateway.url


@pytest.mark.parametrize("role", ["node", "gateway"])
async def test_a_downstream_health_that_is_not_json_is_502_on_both(role: str) -> None:
    async with odd_downstream() as down, server_over(role, down) as url:
        shallow = await exchange(url, http_request("GET", "/health"))
        assert shallow.status == 200 and json.loads(shallow.body)["role"] == role
        for query in ("deep=1", "deep=true", "x=1&deep=1"):
            deep = await exchange(url, http_request("GET", f"/health?{query}"))
            assert deep.status == 502, (query, deep.body)
            error = json.loads(deep.body)["error"]
            assert (error["code"], error["hop"]) == ("downstream_bad_response", down)


@pytest.mark.parametrize("role", ["node", "gateway"])
async def test_deleting_a_session_nobody_knows_is_404_on_both(role: str) -> None:
    async with odd_downstream() as down, server_over(role, down) as url:
        answer = await exchange(url, http_request("DELETE", "/sessions/nobody"))
        assert answer.status == 404
        assert json.loads(answer.body)["error"]["code"] == "not_found"


def test_the_handlers_are_the_core_route_table() -> None:
    """Routing happens once, in the core: every route it accepts has a
    handler, and there is no handler for a route it would refuse."""
    control = ControlEndpoints(role="node", metrics=ServerMetrics("t"), downstream=None,
                               timeout=1.0, info=dict, end_here=lambda s: False)  # fmt: skip
    assert control.handlers.keys() == DEFAULT_ROUTES.keys()
