"""Raw-socket helpers for the security tests (issue 5): requests built byte by
byte, sent to real processes, answers parsed without any HTTP library that
could tidy up what a hostile peer sends or what a node answers.
"""

from __future__ import annotations

import json
import socket
import ssl
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

Pairs = list[tuple[bytes, bytes]]

TENSOR = np.arange(16, dtype=np.float32).reshape(1, 4, 4) - 7.25
BODY = TENSOR.tobytes()


def new_session() -> str:
    return str(uuid.uuid4())


def host_port(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    return host.strip("[]"), int(port)


def wire(
    session: str | None,
    *,
    shape: bytes = b"1,4,4",
    dtype: bytes = b"float32",
    index: int | None = 0,
    total: int | None = 1,
    position: int | None = None,
    encoding: bytes | None = None,
) -> Pairs:
    """The wire-2 §2 request headers of one chunk (session None: gateway style)."""
    pairs: Pairs = [
        (b"Content-Type", b"application/octet-stream"),
        (b"X-Meshnet-Wire", b"2"),
        (b"X-Meshnet-Shape", shape),
        (b"X-Meshnet-Dtype", dtype),
    ]
    if session is not None:
        pairs.append((b"X-Meshnet-Session", session.encode()))
    if index is not None:
        pairs.append((b"X-Meshnet-Chunk-Index", b"%d" % index))
    if total is not None:
        pairs.append((b"X-Meshnet-Chunk-Total", b"%d" % total))
    if position is not None:
        pairs.append((b"X-Meshnet-Position", b"%d" % position))
    if encoding is not None:
        pairs.append((b"X-Meshnet-Encoding", encoding))
    return pairs


def without(pairs: Pairs, name: bytes) -> Pairs:
    return [(k, v) for k, v in pairs if k.lower() != name.lower()]


def replacing(pairs: Pairs, name: bytes, value: bytes) -> Pairs:
    return [(k, value if k.lower() == name.lower() else v) for k, v in pairs]


def request(
    pairs: Sequence[tuple[bytes, bytes]],
    body: bytes = BODY,
    *,
    method: bytes = b"POST",
    target: bytes = b"/forward",
    version: bytes = b"HTTP/1.1",
    length: bytes | str | None = "auto",
    host: bytes = b"localhost",  # a name every server serves (a gateway checks Host)
    close: bool = True,
    token: str | None = None,
) -> bytes:
    """One request as bytes: request line, Host, ``pairs``, Content-Length, body."""
    lines = [method + b" " + target + b" " + version, b"Host: " + host]
    if close:
        lines.append(b"Connection: close")
    if token is not None:
        lines.append(b"Authorization: Bearer " + token.encode())
    lines += [name + b": " + value for name, value in pairs]
    if length == "auto":
        lines.append(b"Content-Length: %d" % len(body))
    elif isinstance(length, bytes):
        lines.append(b"Content-Length: " + length)
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


@dataclass
class Answer:
    raw: bytes
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    @property
    def error(self) -> dict:
        return json.loads(self.body)["error"]

    @property
    def code(self) -> str | None:
        return self.error["code"] if self.status >= 400 else None


def parse_answer(raw: bytes) -> Answer:
    """The first response in ``raw`` (its status line, headers, and body)."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep or not head.startswith(b"HTTP/1.1 "):
        raise AssertionError(f"not an HTTP/1.1 response: {raw[:200]!r}")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get(b"content-length", b"0"))
    return Answer(raw, status, headers, rest[:length])


def connect(url: str, *, timeout: float = 60.0, ssl_context: ssl.SSLContext | None = None):
    host, port = host_port(url)
    sock = socket.create_connection((host, port), timeout=timeout)
    if ssl_context is not None:
        return ssl_context.wrap_socket(sock, server_hostname=host)
    return sock


def exchange(
    url: str,
    data: bytes,
    *,
    half_close: bool = True,
    timeout: float = 60.0,
    ssl_context: ssl.SSLContext | None = None,
    limit: int = 64 << 20,
) -> bytes:
    """Send ``data``, half-close, read until the server closes (bounded)."""
    out = bytearray()
    with connect(url, timeout=timeout, ssl_context=ssl_context) as sock:
        sock.sendall(data)
        if half_close and ssl_context is None:
            sock.shutdown(socket.SHUT_WR)
        while len(out) < limit:
            try:
                piece = sock.recv(1 << 16)
            except (ConnectionResetError, ssl.SSLError):
                break
            if not piece:
                break
            out += piece
    return bytes(out)


def send(url: str, data: bytes, **kwargs) -> Answer:
    return parse_answer(exchange(url, data, **kwargs))


def get(url: str, target: str, *, token: str | None = None, **kwargs) -> Answer:
    lines = [f"GET {target} HTTP/1.1", "Host: localhost", "Connection: close"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    return send(url, ("\r\n".join(lines) + "\r\n\r\n").encode(), **kwargs)


def metric(url: str, name: str, *, token: str | None = None) -> float:
    """One unlabelled sample of the server's ``/metrics``."""
    text = get(url, "/metrics", token=token).body.decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, in KiB, from /proc."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


def valid_chunk_round_trip(url: str, *, token: str | None = None, **kwargs) -> None:
    """A fresh session's single chunk comes back bit-exact (the echo stage)."""
    answer = send(url, request(wire(new_session()), token=token), **kwargs)
    assert answer.status == 200, answer.raw[:500]
    assert answer.headers[b"x-meshnet-shape"] == b"1,4,4"
    assert answer.headers[b"x-meshnet-dtype"] == b"float32"
    assert answer.body == BODY
