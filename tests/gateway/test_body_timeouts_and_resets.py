"""Issue 20's smaller holes, over real sockets.

* A ``/v1`` body (any endpoint's) gets the body timeout (``--timeout``),
  as a ``/forward`` body does, not the head timeout (wire-2 §2.6).
* A wire-2 client that resets its connection mid-run at the gateway: the
  run is cancelled, the session forgotten there and deleted down the chain
  (wire-2 §3.7).
"""

from __future__ import annotations

import json
import socket
import struct
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from anyio.abc import SocketAttribute

from meshnet_runtime.endpoints import parse_endpoint
from meshnet_runtime.transports import connect
from support.gateway import chain
from support.openai import fake_stages, serve_openai, write_model_dir
from support.waiting import wait_until
from support.wire import forward_request, read_answer

pytestmark = pytest.mark.anyio

LIMIT = 30


def completion_head(body: bytes) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "tiny", context=256)


async def test_a_v1_body_slower_than_the_head_timeout_is_served(model_dir: Path) -> None:
    flags = ["--head-timeout", "1", "--timeout", "30"]
    async with serve_openai(model_dir, stages=fake_stages(2), gateway_flags=flags) as served:
        body = json.dumps({"model": "tiny", "prompt": "hello there", "max_tokens": 2}).encode()
        stream = await connect(parse_endpoint(served.url))
        try:
            await stream.send(completion_head(body))
            # The body trickles in over ~2 s: twice the head timeout.
            for start in range(0, len(body), -(-len(body) // 5)):
                await anyio.sleep(0.4)  # stall under test: a body slower than the head timeout
                await stream.send(body[start : start + -(-len(body) // 5)])
            answer = await read_answer(stream, limit=LIMIT)
        finally:
            await stream.aclose()
        assert answer.status == 200, answer.body
        assert json.loads(answer.body)["choices"][0]["text"] is not None


async def test_a_v1_body_slower_than_the_body_timeout_is_408(model_dir: Path) -> None:
    flags = ["--head-timeout", "1", "--timeout", "2"]
    async with serve_openai(model_dir, stages=fake_stages(2), gateway_flags=flags) as served:
        body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 2}).encode()
        stream = await connect(parse_endpoint(served.url))
        try:
            await stream.send(completion_head(body) + body[:5])  # the rest never comes
            answer = await read_answer(stream, limit=LIMIT)
        finally:
            await stream.aclose()
        error = json.loads(answer.body)["error"]
        assert (answer.status, error["code"]) == (408, "request_timeout")
        assert "body" in error["message"]


def inflight_bytes(app: Any) -> float:
    value = app.metrics.registry.get_sample_value("meshnet_inflight_tensor_bytes")
    return 0.0 if value is None else value


async def test_a_wire2_client_reset_mid_run_cancels_it_down_the_chain() -> None:
    # 40 chunks of one token, one at a time, 100 ms per node each: ~8 s of
    # work, of which the client waits for a few chunks and then resets. The
    # chunk the entry had in hand still goes down and waits at the last node
    # for a predecessor of a session deleted there; it ends (409) after the
    # reorder timeout, shortened here so the chain is idle sooner.
    node_flags = ["--backend", "count", "--delay-ms", "100", "--session-ttl", "600",
                  "--reorder-timeout", "1"]  # fmt: skip
    gateway_flags = ["--chunk-tokens", "1", "--inflight", "1", "--session-ttl", "600"]
    async with chain(2, node_flags=node_flags, gateway_flags=gateway_flags) as c:
        entry, last = (node.app for node in c.nodes)
        body = np.zeros((1, 40, 4), dtype="<f4").tobytes()
        fields = [("X-Meshnet-Shape", "1,40,4"), ("X-Meshnet-Dtype", "float32")]
        stream = await connect(parse_endpoint(c.gateway.url))
        await stream.send(forward_request(fields, body))
        await wait_until(lambda: last.tokens_computed >= 2, "the run under way on both nodes")
        raw = stream.extra(SocketAttribute.raw_socket)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()  # a reset, not a FIN
        # Gone everywhere (far below the 600 s TTL), the one chunk a node had
        # in hand done, and the client's connection at the gateway over: the
        # run ended with it, so no chunk of it can go down any more.
        await wait_until(
            lambda: (
                not (
                    len(entry.table)
                    or len(last.table)
                    or len(c.gateway.app.sessions)
                    or inflight_bytes(entry)
                    or inflight_bytes(last)
                    or c.gateway.server._connections
                )
            ),
            "the run cancelled down the chain",
            timeout=LIMIT,
        )
        assert entry.tokens_computed < 40 and last.tokens_computed < 40
        assert entry.info()["sessions"] == last.info()["sessions"] == 0
