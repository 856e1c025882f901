"""The raw-socket floor for the one-hop comparison: a length-prefixed TCP echo.

    python -m meshnet_bench._raw_echo

Prints ``raw echo listening on tcp://127.0.0.1:PORT`` once ready (the same
ready-line shape as the servers, so the bench starts both alike). Each
message is an 8-byte little-endian length and that many bytes, read with
``recv_into`` straight into one buffer (up to 1 MiB a call) and sent back
with ``sendall``: a plain blocking socket, the kernel's copies and nothing
else — no event loop, no HTTP, no headers, no decode. An earlier version
served with anyio (``receive()`` allocates a bytes object per read, then a
copy into the buffer) and measured slower than the node it was the floor of.

``receive_exactly`` and ``round_trip`` are the client side, used by the
bench on anyio like the node's client.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import struct

import numpy as np
from anyio.abc import ByteStream

READ_SIZE = 1024 * 1024


async def receive_exactly(stream: ByteStream, n: int) -> memoryview:
    # The same kind of buffer a node reads a body into (numpy.empty, see
    # meshnet_proto's body_buffer): a zero-filled bytearray faults its pages
    # in without huge pages and made this "floor" slower than the node.
    view = np.empty(n, dtype=np.uint8).data
    filled = 0
    while filled < n:
        data = await stream.receive(min(READ_SIZE, n - filled))
        view[filled : filled + len(data)] = data
        filled += len(data)
    return view


def _recv_exactly(conn: socket.socket, n: int) -> memoryview | None:
    """``n`` bytes read straight into one buffer (``recv_into``: the kernel's
    copy and nothing else); None at a clean end of stream."""
    view = np.empty(n, dtype=np.uint8).data
    filled = 0
    while filled < n:
        got = conn.recv_into(view[filled:], min(READ_SIZE, n - filled))
        if not got:
            return None
        filled += got
    return view


def echo(conn: socket.socket) -> None:
    with conn:
        while (head := _recv_exactly(conn, 8)) is not None:
            (n,) = struct.unpack("<Q", head)
            body = _recv_exactly(conn, n)
            if body is None:
                return
            conn.sendall(body)


async def round_trip(stream: ByteStream, payload: bytes | memoryview) -> memoryview:
    """What the client does: length, payload, then the payload back."""
    await stream.send(struct.pack("<Q", len(payload)))
    await stream.send(payload)  # type: ignore[arg-type]  # anyio's streams take any bytes-like
    return await receive_exactly(stream, len(payload))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Accepted for symmetry with the servers it is compared with; unused.
    parser.add_argument("--async-backend", choices=("trio", "asyncio"), default="trio")
    parser.parse_args()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        print(f"raw echo listening on tcp://127.0.0.1:{port}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:  # one client at a time: the bench opens one
                conn, _ = listener.accept()
                with contextlib.suppress(OSError):
                    echo(conn)


if __name__ == "__main__":
    main()
