"""A decode step's CPU at one hop, without sockets (docs/performance.md, decode).

``meshnet bench --only decode`` times round trips over loopback with the
client in the same process, so the node's own cost is diluted by the
client's and blurred by the machine's noise. This drives each server's
connection loop over an in-memory stream instead, fed the same decode-step
requests (``[1, 1, 8192]`` bfloat16, one session, position after position),
and prints the CPU per request of:

* the bench's bare trio + h11 echo (``meshnet_bench.decode``);
* meshnet's runtime and core (``HttpServer``) with an application that only
  echoes the tensor back: what the request cycle costs by itself;
* the echo node (``meshnet-node``'s application: sequencing, fingerprint,
  stage, encode, metrics).

Minimum over alternating rounds. To compare two trees, run it under each
(``PYTHONPATH=<tree>/src``), alternating, and compare the ratios.

    PYTHONPATH=src python benchmarks/bench_hop_cpu.py [--rounds 15] [--requests 500]
"""

from __future__ import annotations

import argparse
import gc
import time
import uuid
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import numpy as np

from meshnet_bench import decode
from meshnet_bench._support import QUIET
from meshnet_bench.activations import make_activation
from meshnet_node import build_node
from meshnet_node.config import NodeConfig
from meshnet_proto import (
    ActivationHead,
    ActivationReceived,
    ClientConnection,
    EndpointRequest,
    Limits,
    ServerConnection,
    WireHeaders,
)
from meshnet_runtime.http_server import ActivationReply, HttpServer, RequestContext


class ScriptedStream(anyio.abc.ByteStream):
    """Hands out the prepared requests one receive each; counts what is sent."""

    def __init__(self, requests: list[bytes]) -> None:
        self.requests = requests
        self.next = 0
        self.sent = 0

    async def receive(self, max_bytes: int = 65536) -> bytes:
        await anyio.lowlevel.checkpoint()  # as a socket's receive is
        if self.next == len(self.requests):
            raise anyio.EndOfStream
        self.next += 1
        return self.requests[self.next - 1]

    async def send(self, item: Any) -> None:
        await anyio.lowlevel.checkpoint()
        self.sent += len(item)

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


class EchoApplication:
    """The least an application can do: the tensor back, request-only headers off."""

    async def handle_activation_head(self, event: ActivationHead, ctx: RequestContext) -> None:
        pass

    async def handle_activation(
        self, event: ActivationReceived, ctx: RequestContext
    ) -> ActivationReply:
        headers = event.headers.replace(deadline_ms=None, stage=None, session_key=None)
        return ActivationReply(headers, event.tensor.reshape(-1).view(np.uint8).data)

    async def handle_endpoint(self, event: EndpointRequest, ctx: RequestContext) -> Any:
        raise NotImplementedError

    def cancel_on_disconnect(self, event: EndpointRequest | ActivationReceived) -> bool:
        return False


def decode_steps(count: int) -> list[bytes]:
    """``count`` one-token requests of one session, as DownstreamPool sends them."""
    array = make_activation(1, decode.HIDDEN)
    body = array.reshape(-1).view(np.uint8).data
    session = str(uuid.uuid4())
    out = []
    for position in range(count):
        headers = WireHeaders(shape=array.shape, dtype="bfloat16", session=session,
                              chunk_index=0, chunk_total=1, encoding="identity",
                              position=position)  # fmt: skip
        pieces = ClientConnection(host="127.0.0.1").send_activation(headers, body)
        out.append(b"".join(bytes(piece) for piece in pieces))
    return out


async def measure(rounds: int, count: int) -> dict[str, float]:
    app, node = build_node(NodeConfig.load([*QUIET, "--async-backend", "trio"]))
    runtime = HttpServer(EchoApplication(), lambda: ServerConnection(limits=Limits()))
    servers = {
        "bare trio + h11 echo": decode._bare_echo,
        "runtime + core, echo application": runtime.serve_stream,
        "echo node": node.serve_stream,
    }
    best = {name: float("inf") for name in servers}
    try:
        async with anyio.create_task_group() as watchdogs:
            # As a listening server runs them (HttpServer.serve).
            await watchdogs.start(runtime.watch_deadlines)
            await watchdogs.start(node.watch_deadlines)
            await _rounds(servers, best, rounds, count)
            watchdogs.cancel_scope.cancel()
    finally:
        await app.aclose()
    return best


async def _rounds(servers: dict[str, Any], best: dict[str, float], rounds: int, count: int) -> None:
    """The best CPU per request of each server over ``rounds`` alternating rounds."""
    for _ in range(rounds):
        for name, serve in servers.items():
            stream = ScriptedStream(decode_steps(count))
            gc.collect()
            start = time.perf_counter()
            await serve(stream)
            elapsed = (time.perf_counter() - start) / count
            if stream.next != count or stream.sent < count * 16384:
                raise RuntimeError(f"{name} did not answer every request")
            best[name] = min(best[name], elapsed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--requests", type=int, default=500)
    args = parser.parse_args()
    best = anyio.run(measure, args.rounds, args.requests, backend="trio")
    bare = best["bare trio + h11 echo"]
    for name, seconds in best.items():
        print(f"{name:34s} {seconds * 1e6:7.1f} us   {seconds / bare:5.2f}x bare")


if __name__ == "__main__":
    main()
