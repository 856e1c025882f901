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

import anyio
import pytest

from meshnet_runtime.endpoints import parse_endpoint
from meshnet_runtime.transports import connect
from openai_support import fake_stages, serve_openai, write_model_dir
from wire_support import read_answer

pytestmark = pytest.mark.anyio

LIMIT = 30


def completion_head(body: bytes) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
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
                await anyio.sleep(0.4)
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


def reset_socket(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer gets a TCP reset, not a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
