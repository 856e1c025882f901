"""Wire 1, the baseline: a float32 tensor base64-encoded inside a JSON body.

The format meshnet had before wire 2 (the US-002 story)::

    {"shape": [1, 2048, 4096], "dtype": "float32", "data": "<base64>"}

Only the benchmark speaks it. It runs on the same stack as wire 2 (h11 over
anyio, on trio by default) and with the same plumbing choices — keep-alive,
bodies read up to 1 MiB at a time into one buffer sized from
``Content-Length``, an answer relayed upstream unchanged — so that wire 1
against wire 2 compares the formats, not two HTTP stacks. Every hop does
what a wire-1 node had to do to compute: parse the JSON, decode the base64
into an array, run the (echo) stage, encode the output again.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio
import h11
import numpy as np
from anyio.abc import ByteStream, SocketAttribute

__all__ = ["Wire1Client", "decode_body", "encode_body", "serve_wire1"]

READ_SIZE = 1024 * 1024
MAX_BODY = 2 * 1024 * 1024 * 1024  # a benchmark server: bounded all the same


def encode_body(array: np.ndarray) -> bytes:
    """The wire-1 body of ``array`` (sent as its own dtype, float32 in the bench)."""
    document = {
        "shape": list(array.shape),
        "dtype": str(array.dtype),
        "data": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii"),
    }
    return json.dumps(document).encode()


def decode_body(body: bytes | bytearray | memoryview) -> np.ndarray:
    document = json.loads(bytes(body))
    raw = base64.b64decode(document["data"])
    return np.frombuffer(raw, dtype=np.dtype(document["dtype"])).reshape(document["shape"])


async def _read_body(
    conn: h11.Connection, stream: ByteStream, head: h11.Request | h11.Response
) -> bytearray:
    """The message body after ``head``, into one buffer sized from Content-Length."""
    length = next((int(v) for k, v in head.headers if k == b"content-length"), 0)
    if length > MAX_BODY:
        raise ValueError(f"body of {length} bytes over {MAX_BODY}")
    body = bytearray(length)
    view = memoryview(body)
    filled = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive(READ_SIZE))
        elif isinstance(event, h11.Data):
            view[filled : filled + len(event.data)] = event.data
            filled += len(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return body
        else:
            raise ValueError(f"unexpected {type(event).__name__} in a body")


async def _send(
    stream: ByteStream,
    conn: h11.Connection,
    head: h11.Request | h11.Response,
    body: bytes | bytearray,
) -> None:
    await stream.send(conn.send(head))
    await stream.send(conn.send(h11.Data(data=body)))  # type: ignore[arg-type]
    await stream.send(conn.send(h11.EndOfMessage()))


def _json_headers(body: bytes | bytearray) -> list[tuple[str, str]]:
    return [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]


class Wire1Client:
    """One keep-alive h11 connection to a wire-1 server: ``await post(body)``."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._stream: ByteStream | None = None
        self._conn = h11.Connection(h11.CLIENT)
        self._lock = anyio.Lock()

    @classmethod
    def for_url(cls, url: str) -> Wire1Client:
        host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
        return cls(host, int(port))

    async def post(self, body: bytes | bytearray) -> bytearray:
        async with self._lock:
            if self._stream is None:
                self._stream = await anyio.connect_tcp(self.host, self.port)
            request = h11.Request(
                method="POST",
                target="/forward",
                headers=[("Host", self.host), *_json_headers(body)],
            )
            await _send(self._stream, self._conn, request, body)
            while True:
                event = self._conn.next_event()
                if event is h11.NEED_DATA:
                    self._conn.receive_data(await self._stream.receive(READ_SIZE))
                    continue
                break
            if not isinstance(event, h11.Response) or event.status_code != 200:
                raise RuntimeError(f"wire-1 server answered {event!r}")
            answer = await _read_body(self._conn, self._stream, event)
            self._conn.start_next_cycle()
            return answer

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
            self._stream = None


@dataclass(frozen=True, slots=True)
class Wire1Server:
    url: str


Stage = Callable[[np.ndarray], np.ndarray]


@contextlib.asynccontextmanager
async def serve_wire1(
    next_url: str | None = None, stage: Stage = lambda array: array
) -> AsyncIterator[Wire1Server]:
    """A wire-1 hop on a free loopback port until the block ends.

    Each ``POST`` body is decoded into an array, run through ``stage`` and
    encoded again; with ``next_url`` that body is posted downstream and the
    answer relayed unchanged, else it is the answer. A wire-1 gateway is this
    hop with an identity stage in front of the first node.
    """
    downstream = Wire1Client.for_url(next_url) if next_url else None

    async def handle(stream: ByteStream) -> None:
        conn = h11.Connection(h11.SERVER)
        async with stream:
            # A peer gone, bad HTTP or an oversized body: this connection ends.
            with contextlib.suppress(
                anyio.EndOfStream, anyio.BrokenResourceError, h11.RemoteProtocolError, ValueError
            ):
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        conn.receive_data(await stream.receive(READ_SIZE))
                        continue
                    if not isinstance(event, h11.Request):
                        return
                    body: bytes | bytearray = encode_body(
                        stage(decode_body(await _read_body(conn, stream, event)))
                    )
                    if downstream is not None:
                        body = await downstream.post(body)
                    await _send(
                        stream,
                        conn,
                        h11.Response(status_code=200, headers=_json_headers(body)),
                        body,
                    )
                    conn.start_next_cycle()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        port = listener.extra(SocketAttribute.local_port)
        try:
            yield Wire1Server(f"http://127.0.0.1:{port}")
        finally:
            tg.cancel_scope.cancel()
            if downstream is not None:
                with anyio.CancelScope(shield=True):
                    await downstream.aclose()
