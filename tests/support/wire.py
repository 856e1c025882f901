"""The one raw-HTTP toolkit of the tests: build a request, read an answer.

Tests that must put exact bytes on the wire (a half-close, a malformed
head, a body that stops) build them here instead of each writing its own
f-string, and read the answer with the one reader that skips interim 1xx
answers (``100 Continue``) the way every HTTP client must.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import ByteStream

from meshnet_runtime.endpoints import parse_endpoint
from meshnet_runtime.transports import connect

Fields = Mapping[str, str] | Iterable[tuple[str, str]]


def http_request(method: str, target: str, fields: Fields = (), body: bytes = b"") -> bytes:
    """``method target HTTP/1.1`` with ``Host``, ``fields`` and a
    ``Content-Length`` when there is a body (or the method is POST)."""
    pairs = list(fields.items()) if isinstance(fields, Mapping) else list(fields)
    if body or method == "POST":
        pairs.append(("Content-Length", str(len(body))))
    head = "".join(f"{name}: {value}\r\n" for name, value in pairs)
    return f"{method} {target} HTTP/1.1\r\nHost: localhost\r\n{head}\r\n".encode() + body


def forward_request(fields: Fields, body: bytes, *, token: str | None = None) -> bytes:
    """``POST /forward`` of ``body`` with the wire-2 ``fields`` given (and a bearer token)."""
    given = list(fields.items()) if isinstance(fields, Mapping) else list(fields)
    pairs = [("Content-Type", "application/octet-stream")]  # unless the fields say otherwise
    if any(name.lower() == "content-type" for name, _ in given):
        pairs = []
    pairs += given
    if token:
        pairs.append(("Authorization", f"Bearer {token}"))
    return http_request("POST", "/forward", pairs, body)


@dataclass(frozen=True)
class Answer:
    """A final answer; unpacks as ``status, headers, body``."""

    status: int
    headers: dict[str, str]  # lowercase names
    body: bytes
    interim: int = 0  # how many 1xx answers came before this one

    def __iter__(self) -> Iterator[Any]:
        return iter((self.status, self.headers, self.body))

    def __getitem__(self, item: int) -> Any:
        return (self.status, self.headers, self.body)[item]


async def read_answer(stream: ByteStream, *, limit: float = 60.0) -> Answer:
    """The next final answer on ``stream`` (1xx skipped and counted), bounded
    in time so that a server that never answers fails the test."""
    buf = b""
    interim = 0
    with anyio.fail_after(limit):
        while True:
            while b"\r\n\r\n" not in buf:
                buf += await stream.receive()
            head, _, buf = buf.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            if status >= 200:
                break
            interim += 1
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])
        }
        length = int(headers.get("content-length", "0"))
        while len(buf) < length:
            buf += await stream.receive()
    return Answer(status, headers, buf[:length], interim)


async def exchange(url: str, data: bytes, *, half_close: bool = False) -> Answer:
    """Send ``data`` on a new connection (then half-close it if asked), read the answer."""
    stream = await connect(parse_endpoint(url))
    try:
        await stream.send(data)
        if half_close:
            await stream.send_eof()  # type: ignore[attr-defined]
        return await read_answer(stream)
    finally:
        await stream.aclose()


def raw_forward(session: str) -> bytes:
    """A whole ``POST /forward`` of a [1, 4] float32 chunk as raw bytes, for a
    test that writes to a socket itself (no client in between)."""
    return (
        "POST /forward HTTP/1.1\r\nHost: t\r\nContent-Type: application/octet-stream\r\n"
        "X-Meshnet-Shape: 1,4\r\nX-Meshnet-Dtype: float32\r\n"
        f"X-Meshnet-Session: {session}\r\nX-Meshnet-Chunk-Index: 0\r\n"
        "X-Meshnet-Chunk-Total: 1\r\nContent-Length: 16\r\n\r\n"
    ).encode() + bytes(range(16))
