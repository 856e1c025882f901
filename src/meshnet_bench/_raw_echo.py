"""The raw-socket floor for the one-hop comparison: a length-prefixed TCP echo.

    python -m meshnet_bench._raw_echo [--async-backend trio]

Prints ``raw echo listening on tcp://127.0.0.1:PORT`` once ready (the same
ready-line shape as the servers, so the bench starts both alike). Each
message is an 8-byte little-endian length and that many bytes, read into
one buffer up to 1 MiB at a time and sent back: the kernel's copies and the
event loop, nothing else — no HTTP, no headers, no decode.
"""

from __future__ import annotations

import argparse
import contextlib
import struct

import anyio
import numpy as np
from anyio.abc import ByteStream, SocketAttribute

READ_SIZE = 1024 * 1024


async def receive_exactly(stream: ByteStream, n: int) -> memoryview:
    # The same kind of buffer a node reads a body into (numpy.empty, see
    # meshnet_proto's body_buffer): a zero-filled bytearray faults its pages
    # in without huge pages and made this "floor" slower than the node.
    view = memoryview(np.empty(n, dtype=np.uint8))
    filled = 0
    while filled < n:
        data = await stream.receive(min(READ_SIZE, n - filled))
        view[filled : filled + len(data)] = data
        filled += len(data)
    return view


async def echo(stream: ByteStream) -> None:
    async with stream:
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
            while True:
                (n,) = struct.unpack("<Q", await receive_exactly(stream, 8))
                await stream.send(await receive_exactly(stream, n))


async def round_trip(stream: ByteStream, payload: bytes | memoryview) -> memoryview:
    """What the client does: length, payload, then the payload back."""
    await stream.send(struct.pack("<Q", len(payload)))
    await stream.send(payload)
    return await receive_exactly(stream, len(payload))


async def serve() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(SocketAttribute.local_port)
    print(f"raw echo listening on tcp://127.0.0.1:{port}", flush=True)
    await listener.serve(echo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--async-backend", choices=("trio", "asyncio"), default="trio")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        anyio.run(serve, backend=args.async_backend)


if __name__ == "__main__":
    main()
