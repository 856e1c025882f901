"""One wire-2 hop against the raw transport it runs on.

    .venv/bin/python benchmarks/bench_hop.py [--repeat 7] [--uds] [--async-backend asyncio]

In this process, on the same bytes, round trip by round trip:

* **raw**: an anyio echo server on 127.0.0.1 (or a Unix socket with
  ``--uds``) that reads an 8-byte length and then that many bytes into one
  buffer, and sends them back; the client sends length + payload and reads
  the payload back. Reads take up to 1 MiB at a time. This is the floor: the
  kernel's copies and the event loop, nothing else.
* **node identity**: a last-stage ``meshnet-node`` (echo stage) in this
  process, reached through ``DownstreamPool.forward`` — the client a node
  uses toward its ``--next`` — with the payload as a bfloat16 activation;
  the node echoes it back.
* **node zstd**: the same with a zstd body (compressed once, before timing;
  the node decompresses, echoes and compresses again, as a real hop does).

Throughput is tensor bytes (raw size) per round trip; every node figure is
divided by the raw baseline of the same size. Repeats are interleaved (raw,
identity, zstd, raw, …) and medians reported, so a shared machine's noise
falls on all three alike. Answers are checked bit-identical to the input.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import struct
import tempfile
import time
import uuid
from pathlib import Path

import anyio
import numpy as np
import zstandard
from anyio.abc import ByteStream

from meshnet_cli.demo import make_activation
from meshnet_node import serve_node
from meshnet_proto import ActivationResponse, WireHeaders, decode_tensor
from meshnet_runtime.config import load_config
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool

MiB = 1024 * 1024
RAW_READ = 1 * MiB
HIDDEN = 4096


async def receive_exactly(stream: ByteStream, n: int) -> bytearray:
    buffer = bytearray(n)
    view = memoryview(buffer)
    filled = 0
    while filled < n:
        data = await stream.receive(min(RAW_READ, n - filled))
        view[filled : filled + len(data)] = data
        filled += len(data)
    return buffer


async def raw_echo(stream: ByteStream) -> None:
    async with stream:
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
            while True:
                (n,) = struct.unpack("<Q", await receive_exactly(stream, 8))
                await stream.send(await receive_exactly(stream, n))


async def raw_round_trip(stream: ByteStream, payload: bytes) -> bytearray:
    await stream.send(struct.pack("<Q", len(payload)))
    await stream.send(payload)
    return await receive_exactly(stream, len(payload))


def headers_for(array: np.ndarray, encoding: str) -> WireHeaders:
    return WireHeaders(
        shape=array.shape,
        dtype="bfloat16",
        session=str(uuid.uuid4()),
        chunk_index=0,
        chunk_total=1,
        encoding=encoding,
        position=0,
    )


async def node_round_trip(
    pool: DownstreamPool, array: np.ndarray, encoding: str, body: bytes
) -> ActivationResponse:
    deadline = Deadline.after(60.0)
    response = await pool.forward(headers_for(array, encoding), body, deadline)
    if not isinstance(response, ActivationResponse):
        raise SystemExit(f"node answered an error: {response.error}")
    return response


async def main(args: argparse.Namespace) -> None:
    quiet = ["--log-level", "warning"]
    with tempfile.TemporaryDirectory(prefix="meshnet-hop-") as tmp:
        async with contextlib.AsyncExitStack() as stack:
            if args.uds:
                raw_listener = await anyio.create_unix_listener(Path(tmp) / "raw.sock")
                node_flags = ["--uds", str(Path(tmp) / "node.sock")]
            else:
                raw_listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
                node_flags = ["--host", "127.0.0.1", "--port", "0"]
            await stack.enter_async_context(raw_listener)
            tg = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(tg.cancel_scope.cancel)
            tg.start_soon(raw_listener.serve, raw_echo)
            node = await stack.enter_async_context(
                serve_node(load_config("node", [*quiet, *node_flags], {}))
            )
            pool = DownstreamPool(node.url, max_connections=1)
            stack.push_async_callback(pool.aclose)
            if args.uds:
                raw = await anyio.connect_unix(Path(tmp) / "raw.sock")
            else:
                raw = await anyio.connect_tcp("127.0.0.1", raw_listener.extra(
                    anyio.abc.SocketAttribute.local_port))  # fmt: skip
            await stack.enter_async_context(raw)
            compressor = zstandard.ZstdCompressor(level=1, write_content_size=True)

            transport = "Unix socket" if args.uds else "TCP 127.0.0.1"
            print(
                f"one hop vs raw echo, {transport}, {args.async_backend}; median of "
                f"{args.repeat} interleaved round trips; MB/s = tensor MB / round trip"
            )
            print(f"  {'size':>6}  {'raw MB/s':>9}  {'identity':>9} {'ratio':>6}"
                  f"  {'zstd':>9} {'ratio':>6}  bit-identical")  # fmt: skip
            for mib in args.sizes:
                array = make_activation(mib * MiB // (HIDDEN * 2), HIDDEN)
                payload = array.tobytes()
                packed = compressor.compress(payload)
                # Warm-up: connections open, first-touch costs paid.
                await raw_round_trip(raw, payload)
                await node_round_trip(pool, array, "identity", payload)
                await node_round_trip(pool, array, "zstd", packed)
                times: dict[str, list[float]] = {"raw": [], "identity": [], "zstd": []}
                same = True
                for _ in range(args.repeat):
                    for kind in times:
                        start = time.perf_counter()
                        if kind == "raw":
                            echoed: bytes | bytearray = await raw_round_trip(raw, payload)
                        else:
                            body = payload if kind == "identity" else packed
                            response = await node_round_trip(pool, array, kind, body)
                        times[kind].append(time.perf_counter() - start)
                        if kind != "raw":  # checked outside the timed round trip
                            echoed = decode_tensor(response.headers, response.body).tobytes()
                        same = same and echoed == payload
                rate = {k: len(payload) / statistics.median(v) / 1e6 for k, v in times.items()}
                print(
                    f"  {mib:>3} MiB  {rate['raw']:9.0f}  {rate['identity']:9.0f} "
                    f"{rate['identity'] / rate['raw']:5.2f}x  {rate['zstd']:9.0f} "
                    f"{rate['zstd'] / rate['raw']:5.2f}x  {'yes' if same else 'NO'}"
                )
                if not same:
                    raise SystemExit("an echoed payload differs from the input")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16], metavar="MIB")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--uds", action="store_true", help="Unix sockets instead of TCP")
    parser.add_argument("--async-backend", choices=("trio", "asyncio"), default="trio")
    ns = parser.parse_args()
    anyio.run(main, ns, backend=ns.async_backend)
