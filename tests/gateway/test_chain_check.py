"""The chain check over real servers (issue 20, wire-2 §6.2): a chain that
cannot be right says so before it answers — `meshnet-gateway` exits 2 with
one line, a running gateway answers 503 chain_mismatch, deep health says
cannot_serve. Never a 200.

The nodes run in this process with stages whose identity is a model's
(``ModelLike``: layers, vocabulary, context), so every topology is cheap to
build; the gateway that must refuse to start is a real process.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

from meshnet_gateway import open_gateway
from meshnet_gateway.client import Client
from meshnet_gateway.config import GatewayConfig
from meshnet_node import RunningNode, serve_node
from meshnet_node.backends import Stage, echo
from meshnet_node.config import NodeConfig
from meshnet_proto import ErrorResponse
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool
from support.gateway import QUIET, activation
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

MODEL = "5" * 32
OTHER = "6" * 32
N_LAYERS = 30


@dataclass(slots=True)
class ModelLike(Stage):
    """``echo`` that says it is layers ``start:stop`` of a model (wire-2 §6.1)."""

    fields: dict[str, Any] = field(default_factory=dict)

    def identity(self) -> dict[str, Any]:
        return self.fields


def model_stage(start: int, stop: int, *, model: str = MODEL, **more: Any) -> ModelLike:
    fields = {
        "model": model, "weights": "7" * 32, "tokenizer": "8" * 32, "layers": [start, stop],
        "n_layers": N_LAYERS, "vocab": 400, "hidden": 4, "max_context": 8192,
        "engine": "numpy", "dtype": "float32",
        "input": "tokens" if start == 0 else "hidden",
        "output": "logits" if stop == N_LAYERS else "hidden",
        **more,
    }  # fmt: skip
    return ModelLike("model-like", echo, fields=fields)


@dataclass
class Spec:
    stage: Stage | None = None  # None: the echo stub
    flags: Sequence[str] = ()


@contextlib.asynccontextmanager
async def nodes(*specs: Spec) -> AsyncIterator[list[RunningNode]]:
    """A chain of in-process nodes, entry first (each --next the one after)."""
    async with contextlib.AsyncExitStack() as stack:
        running: list[RunningNode] = []
        next_url: str | None = None
        for spec in reversed(specs):
            flags = [*QUIET, *spec.flags, *(["--next", next_url] if next_url else [])]
            node = await stack.enter_async_context(
                serve_node(NodeConfig.load(flags), stage=spec.stage)
            )
            running.insert(0, node)
            next_url = node.url
        yield running


async def gateway_process(entry: str, *flags: str) -> tuple[int, str]:
    """Run `python -m meshnet_gateway` to its end: its status and stderr."""
    command = [sys.executable, "-m", "meshnet_gateway", *QUIET, "--entry", entry, *flags]
    with anyio.fail_after(60):
        done = await anyio.run_process(command, check=False)
    return done.returncode, done.stderr.decode()


def ranges(*pairs: tuple[int, int], **more: Any) -> list[Spec]:
    return [Spec(model_stage(a, b, **more)) for a, b in pairs]


ROWS = {
    "gap": (ranges((0, 14), (15, 30)), (), "layer_gap"),
    "overlap": (ranges((0, 15), (10, 30)), (), "layer_overlap"),
    "wrong-order": (ranges((0, 10), (20, 30), (10, 20)), (), "layer_order"),
    "no-last-stage": (ranges((0, 10), (10, 20)), (), "no_last_stage"),
    "other-checkpoint-at-stage-2": (
        [Spec(model_stage(0, 15)), Spec(model_stage(15, 30, model=OTHER))],
        (),
        "model_mismatch",
    ),
    "smaller-window-deeper": (
        [Spec(model_stage(0, 15)), Spec(model_stage(15, 30), ["--reorder-window", "2"])],
        ("--inflight", "8"),
        "window_too_small",
    ),
    "max-context-above-the-models": (
        ranges((0, 30)),
        ("--max-context", "100000"),
        "context_too_long",
    ),
    "tokens-differ-between-hops": (
        [Spec(None, ["--token", "t-one"]), Spec(None, ["--token", "t-two"])],
        ("--token", "t-one"),
        "token_mismatch",
    ),
}


@pytest.mark.parametrize("row", list(ROWS))
async def test_a_gateway_in_front_of_a_chain_that_cannot_serve_exits_2(row: str) -> None:
    specs, flags, code = ROWS[row]
    async with nodes(*specs) as chain:
        status, stderr = await gateway_process(chain[0].url, *flags)
    lines = [line for line in stderr.splitlines() if line.startswith("meshnet-gateway:")]
    assert status == 2, stderr
    assert len(lines) == 1 and f"the chain cannot serve: {code}: " in lines[0], stderr


@pytest.mark.parametrize("row", ["gap", "tokens-differ-between-hops"])
async def test_a_running_gateway_answers_503_chain_mismatch(row: str) -> None:
    specs, flags, code = ROWS[row]
    token = dict(zip(flags[::2], flags[1::2], strict=True)).get("--token")
    async with nodes(*specs) as chain:
        config = GatewayConfig.load([*QUIET, "--entry", chain[0].url, *flags])
        async with open_gateway(config) as gateway, Client(gateway.url, token=token) as client:
            assert [p.code for p in gateway.app.chain_problems or []] == [code]
            with anyio.fail_after(30):
                response = await _forward(gateway.url, token)
                assert isinstance(response, ErrorResponse) and response.status == 503
                assert (
                    response.error["code"] == "chain_mismatch" and code in response.error["message"]
                )
                assert response.retry_after is not None and response.retry_after >= 1
                deep = await client.pool.request("GET", "/health?deep=1", Deadline.after(10))
                health = json.loads(deep.body)
                assert health["status"] == "cannot_serve"
                assert [p["code"] for p in health["problems"]] == [code]


async def _forward(url: str, token: str | None) -> Any:
    from meshnet_proto import WireHeaders, encode_tensor

    pool = DownstreamPool(url, token=token)
    array = activation(4, 4)
    try:
        return await pool.forward(
            WireHeaders.for_array(array), encode_tensor(array), Deadline.after(10)
        )
    finally:
        await pool.aclose()


async def test_a_healthy_model_chain_passes_and_names_its_entry() -> None:
    async with nodes(*ranges((0, 15), (15, 30))) as chain:
        config = GatewayConfig.load([*QUIET, "--entry", chain[0].url])
        async with open_gateway(config) as gateway:
            assert gateway.app.chain_problems == []
            assert gateway.app.expected_entry == f"{MODEL}/0"
            info = (await Client(gateway.url).info())["chain"]
            assert info == {"checked": True, "problems": [], "expected_entry": f"{MODEL}/0"}


async def test_the_gateways_own_vocabulary_differs() -> None:
    async with nodes(*ranges((0, 30))) as chain:
        config = GatewayConfig.load([*QUIET, "--entry", chain[0].url])
        async with open_gateway(config) as gateway:
            gateway.app.facts["vocab"] = 320  # what a 320-token --model tokenizer gives
            problems = await gateway.app.check_chain()
            assert [p.code for p in problems or []] == ["vocab_mismatch"]
            response = await _forward(gateway.url, None)
            assert response.status == 503 and response.error["code"] == "chain_mismatch"


async def test_deep_health_needs_the_token_and_plain_health_does_not() -> None:
    async with nodes(Spec(None, ["--token", "tok"])) as chain:
        pool = DownstreamPool(chain[0].url)
        try:
            plain = await pool.request("GET", "/health", Deadline.after(10))
            deep = await pool.request("GET", "/health?deep=1", Deadline.after(10))
        finally:
            await pool.aclose()
        assert plain.status == 200
        assert isinstance(deep, ErrorResponse) and deep.status == 401
        assert deep.error["code"] == "unauthorized"


async def test_twenty_concurrent_deep_calls_cost_the_chain_one_walk() -> None:
    async with nodes(Spec(), Spec(), Spec()) as chain:
        seen = {node.url: 0 for node in chain}
        for node in chain:
            control = node.app.control
            original = control.handlers["/health"]

            async def counted(
                event: Any, ctx: Any, url: str = node.url, inner: Any = original
            ) -> Any:
                if "deep" in event.query:
                    seen[url] += 1
                return await inner(event, ctx)

            control.handlers["/health"] = counted
        pool = DownstreamPool(chain[0].url, max_connections=20)
        answers: list[Any] = []
        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    for _ in range(20):

                        async def one() -> None:
                            answers.append(
                                await pool.request("GET", "/health?deep=1", Deadline.after(10))
                            )

                        tg.start_soon(one)
        finally:
            await pool.aclose()
    assert [a.status for a in answers] == [200] * 20
    assert seen[chain[0].url] == 20
    # One walk in flight, then the cache: each hop below asked once (twice
    # if the first walk ended just as a late caller came in).
    assert seen[chain[1].url] <= 2 and seen[chain[2].url] <= 2, seen


async def test_a_replica_restarted_as_another_stage_is_taken_out() -> None:
    b1_cm = nodes(*ranges((15, 30)))
    b2_cm = serve_node(NodeConfig.load(QUIET), stage=model_stage(15, 30))
    async with b1_cm as (b1,), b2_cm as b2:
        port = int(b2.url.rsplit(":", 1)[1])
        entry_flags = [*QUIET, "--next", f"{b1.url},{b2.url}", "--health-interval", "0.1"]
        async with serve_node(NodeConfig.load(entry_flags), stage=model_stage(0, 15)) as a:
            hop = a.app.downstream
            with anyio.fail_after(30):
                await wait_until(
                    lambda: hop.pinned is not None and all(r.identity_read for r in hop.replicas),
                    "both replicas' identities read",
                )
                # b2 goes, and comes back on its port as another checkpoint.
                b2.server.request_shutdown()
                await wait_until(lambda: not all(r.up for r in hop.replicas), "b2 seen down")
                flags = ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
                other = model_stage(15, 30, model=OTHER)
                async with serve_node(NodeConfig.load(flags), stage=other):
                    await wait_until(
                        lambda: any(r.mismatch for r in hop.replicas), "the mismatch seen"
                    )
                    (taken,) = [r for r in hop.describe()["replicas"] if r["mismatch"]]
                    assert taken["url"] == b2.url
                    # Never chosen: twenty new sessions all go to b1.
                    async with Client(a.url) as client:
                        for seed in range(20):
                            await client.forward_chunks(activation(4, 4, seed=seed), chunk_tokens=2)
                    assert {hop.holder(s) for s in list(hop._sticky)} == {b1.url}
                    config = GatewayConfig.load([*QUIET, "--entry", a.url])
                    async with open_gateway(config) as gateway:
                        # Taken out, the hop serves with b1: degraded, not refused.
                        assert gateway.app.chain_problems == []
                        response = await _forward(gateway.url, None)
                        assert response.status == 200
                        health = await _deep_health(gateway.url)
                        assert health["status"] == "degraded", health
                        assert '"state": "mismatch"' in json.dumps(health)


async def _deep_health(url: str) -> Any:
    pool = DownstreamPool(url)
    try:
        response = await pool.request("GET", "/health?deep=1", Deadline.after(10))
        assert response.status == 200, response
        return json.loads(response.body)
    finally:
        await pool.aclose()
