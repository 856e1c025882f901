"""Decode-step latency: one token's activation to a node and back.

Round trips of a ``[1, 1, 8192]`` bfloat16 chunk (16 KiB, identity) — what
one generated token costs a hop — to an echo ``meshnet-node`` in this
process, against a minimal trio + h11 echo server that only reads the body
and sends it back with the request's ``X-Meshnet-*`` headers (so the very
same client, ``DownstreamPool``, reads both answers). The node's chunks
continue one session, position after position, as a decode loop does.
Calls alternate node, bare, node, …; p50 and p99 of each.

Keys: ``decode_p50_us``, ``decode_p99_us`` (the node),
``decode_over_bare_h11_p50`` (node p50 ÷ bare p50).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import anyio
import h11
import numpy as np
from anyio.abc import ByteStream, SocketAttribute

from meshnet_bench.activations import make_activation
from meshnet_node import serve_node
from meshnet_node.config import NodeConfig
from meshnet_proto import ActivationResponse, WireHeaders
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool

from ._result import BenchOptions, SectionResult
from ._support import QUIET, percentile, ratio, us

KEYS = ("decode_p50_us", "decode_p99_us", "decode_over_bare_h11_p50")

HIDDEN = 8192
READ_SIZE = 65536


async def _bare_echo(stream: ByteStream) -> None:
    """HTTP/1.1 echo on h11: body back, ``X-Meshnet-*`` headers copied."""
    conn = h11.Connection(h11.SERVER)
    async with stream:
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive(READ_SIZE))
                    continue
                if not isinstance(event, h11.Request):
                    return
                wire = [(k, v) for k, v in event.headers if k.startswith(b"x-meshnet-")]
                body = bytearray()
                while not isinstance(event := conn.next_event(), h11.EndOfMessage):
                    if event is h11.NEED_DATA:
                        conn.receive_data(await stream.receive(READ_SIZE))
                    elif isinstance(event, h11.Data):
                        body += event.data
                head = h11.Response(
                    status_code=200,
                    headers=[
                        (b"Content-Type", b"application/octet-stream"),
                        (b"Content-Length", str(len(body)).encode()),
                        *wire,
                    ],
                )
                # h11's send() may return None (typed Optional) and its Data
                # is typed bytes; it sends a bytearray as it is.
                await stream.send(
                    conn.send(head)
                    + conn.send(h11.Data(data=body))  # type: ignore[arg-type]
                    + conn.send(h11.EndOfMessage())
                )
                conn.start_next_cycle()


@contextlib.asynccontextmanager
async def serve_bare_echo() -> AsyncIterator[str]:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, _bare_echo)
        try:
            yield f"http://127.0.0.1:{listener.extra(SocketAttribute.local_port)}"
        finally:
            tg.cancel_scope.cancel()


async def measure(steps: int, backend_flags: list[str]) -> dict[str, list[float]]:
    """``steps`` round trips to each server, alternating; seconds per trip."""
    array = make_activation(1, HIDDEN)
    body = array.reshape(-1).view(np.uint8).data
    token = body.tobytes()
    session = str(uuid.uuid4())
    times: dict[str, list[float]] = {"node": [], "bare h11": []}
    async with (
        serve_node(NodeConfig.load([*QUIET, *backend_flags])) as node,
        serve_bare_echo() as bare_url,
    ):
        pools = {
            "node": DownstreamPool(node.url, max_connections=1),
            "bare h11": DownstreamPool(bare_url, max_connections=1),
        }
        try:
            for position in range(steps + 1):  # the first trip of each opens its connection
                # Each step is a one-chunk run continuing the session.
                headers = WireHeaders(
                    shape=array.shape,
                    dtype="bfloat16",
                    session=session,
                    chunk_index=0,
                    chunk_total=1,
                    encoding="identity",
                    position=position,
                )
                for name, pool in pools.items():
                    start = time.perf_counter()
                    response = await pool.forward(headers, body, Deadline.after(30.0))
                    elapsed = time.perf_counter() - start
                    echoed = (
                        isinstance(response, ActivationResponse) and bytes(response.body) == token
                    )
                    if not echoed:
                        raise RuntimeError(f"{name} did not echo the token: {response!r}")
                    if position:
                        times[name].append(elapsed)
        finally:
            for pool in pools.values():
                await pool.aclose()
    return times


def run(options: BenchOptions) -> SectionResult:
    steps = 20 if options.tiny else 500 if options.quick else 3000
    options.progress(f"decode: {steps} one-token round trips, node vs bare h11 echo")
    backend = ["--async-backend", options.async_backend]
    times = anyio.run(measure, steps, backend, backend=options.async_backend)
    p50 = {name: percentile(t, 0.50) for name, t in times.items()}
    p99 = {name: percentile(t, 0.99) for name, t in times.items()}
    result = SectionResult(
        title=f"decode step: [1, 1, {HIDDEN}] bfloat16 round trips, {steps} each, interleaved",
        keys={
            "decode_p50_us": round(p50["node"] * 1e6, 1),
            "decode_p99_us": round(p99["node"] * 1e6, 1),
            "decode_over_bare_h11_p50": ratio(p50["node"], p50["bare h11"]),
        },
    )
    for name in times:
        result.rows.append(
            {
                "server": "echo node" if name == "node" else "bare trio + h11 echo",
                "p50": us(p50[name]),
                "p99": us(p99[name]),
                "p50 vs bare": f"{p50[name] / p50['bare h11']:.2f}x",
            }
        )
    return result
