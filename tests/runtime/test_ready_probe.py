"""``GET /health?ready=1``: whether a server can serve now (an orchestrator's
readiness probe, docs/kubernetes.md), on a node and on a gateway.

A node is ready when the chain below it passes its check (its deep health,
cached); a gateway when its own chain check last passed. Neither needs the
token, and a refusal (503 ``chain_mismatch``) names problem codes only: no
URL, no identity (wire-2 §7).
"""

from __future__ import annotations

import contextlib
import json

import pytest

from meshnet_gateway import open_gateway
from meshnet_gateway.config import GatewayConfig
from meshnet_node import serve_node
from meshnet_node.config import NodeConfig
from support.gateway import closed_port_url
from support.waiting import wait_until
from support.wire import exchange, http_request

pytestmark = pytest.mark.anyio

QUIET = ["--host", "127.0.0.1", "--port", "0", "--log-level", "error"]
TOKEN = ["--token", "chain-secret"]


def _refusal(body: bytes) -> dict[str, object]:
    error = json.loads(body)["error"]
    assert isinstance(error, dict)
    return error


async def test_a_last_stage_is_ready_without_the_token() -> None:
    async with serve_node(NodeConfig.load([*QUIET, *TOKEN])) as node:
        answer = await exchange(node.url, http_request("GET", "/health?ready=1"))
        assert answer.status == 200, answer.body
        assert json.loads(answer.body)["role"] == "node"
        # The deep check still needs it: ready=1 opens nothing more.
        deep = await exchange(node.url, http_request("GET", "/health?deep=1&ready=1"))
        assert deep.status == 401


async def test_a_node_whose_next_hop_is_down_is_not_ready_and_says_no_url() -> None:
    down = closed_port_url()
    async with serve_node(NodeConfig.load([*QUIET, *TOKEN, "--next", down])) as node:
        answer = await exchange(node.url, http_request("GET", "/health?ready=1"))
        assert answer.status == 503
        assert "retry-after" in answer.headers
        error = _refusal(answer.body)
        assert error["code"] == "chain_mismatch"
        assert "downstream_unreachable" in str(error["message"])
        assert down not in answer.body.decode() and error["hop"] is None
        # Liveness is another question: the loop answers.
        plain = await exchange(node.url, http_request("GET", "/health"))
        assert plain.status == 200


async def test_a_node_over_a_ready_last_stage_is_ready() -> None:
    async with (
        serve_node(NodeConfig.load([*QUIET, *TOKEN])) as last,
        serve_node(NodeConfig.load([*QUIET, *TOKEN, "--next", last.url])) as first,
    ):
        answer = await exchange(first.url, http_request("GET", "/health?ready=true"))
        assert answer.status == 200, answer.body


async def test_a_gateway_is_ready_while_its_chain_check_passes() -> None:
    async with serve_node(NodeConfig.load([*QUIET, *TOKEN])) as node:
        config = GatewayConfig.load([*QUIET, *TOKEN, "--entry", node.url])
        async with open_gateway(config) as gateway:
            answer = await exchange(gateway.url, http_request("GET", "/health?ready=1"))
            assert answer.status == 200, answer.body
            assert json.loads(answer.body)["role"] == "gateway"


async def test_a_gateway_whose_chain_never_answered_is_not_ready() -> None:
    config = GatewayConfig.load([*QUIET, "--entry", closed_port_url()])
    async with open_gateway(config) as gateway:
        answer = await exchange(gateway.url, http_request("GET", "/health?ready=1"))
        assert answer.status == 503
        error = _refusal(answer.body)
        assert error["code"] == "chain_mismatch"
        assert "has not answered a check yet" in str(error["message"])


async def test_a_gateway_whose_chain_below_its_entry_went_down_is_not_ready() -> None:
    """The entry answers, the stage below it does not: the gateway's check
    gets no answer (502 from its entry), so it is not ready — its requests
    would meet the same 502."""
    fast = ["--health-interval", "0.2"]
    async with contextlib.AsyncExitStack() as stack:
        last = await stack.enter_async_context(serve_node(NodeConfig.load([*QUIET, *fast])))
        entry_flags = [*QUIET, *fast, "--next", last.url]
        first = await stack.enter_async_context(serve_node(NodeConfig.load(entry_flags)))
        config = GatewayConfig.load([*QUIET, *fast, "--entry", first.url])
        gateway = await stack.enter_async_context(open_gateway(config))
        ready = await exchange(gateway.url, http_request("GET", "/health?ready=1"))
        assert ready.status == 200, ready.body
        last.server.request_shutdown()  # it stops; the node above it stays
        probe = http_request("GET", "/health?ready=1")
        answers = []

        async def refused() -> bool:  # the check runs every 0.2 s
            answers.append(await exchange(gateway.url, probe))
            return answers[-1].status != 200

        await wait_until(refused, "the readiness check refused", every=0.05)
        answer = answers[-1]
        assert answer.status == 503
        assert "got no answer" in str(_refusal(answer.body)["message"])
