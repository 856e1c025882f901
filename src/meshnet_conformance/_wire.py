"""Raw HTTP/1.1 over a socket: the checker writes and reads the bytes itself.

No HTTP library sits between a case and the server under test: a library
would normalise exactly what the cases probe (header case, duplicates,
framing, ``Expect: 100-continue``). Requests are byte strings built here;
responses are read with a bounded reader that holds the server to wire 2's
response rules (a status line, headers, ``Content-Length`` except on 1xx/204).
"""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

__all__ = ["CheckFailed", "Connection", "Response", "Target", "build_request"]

# A response head or body larger than this is a broken server, not a case.
_MAX_HEAD = 64 * 1024
_MAX_BODY = 64 * 1024 * 1024
_READ = 65536


class CheckFailed(Exception):
    """A case's expectation did not hold; the message says what was seen."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where the server under test listens: ``http://``, ``https://`` or ``unix:``."""

    url: str
    tls_ca: str | None = None
    timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.url.startswith("unix:"):
            if not self.url.removeprefix("unix:"):
                raise ValueError(f"unix: URL without a path: {self.url!r}")
            return
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"expected http://host:port, https://host:port or unix:/path, got {self.url!r}"
            )
        if parts.path not in ("", "/"):
            raise ValueError(f"give the server's root URL, not a path: {self.url!r}")

    @property
    def host_header(self) -> str:
        if self.url.startswith("unix:"):
            return "localhost"
        return urlsplit(self.url).netloc

    def connect(self) -> Connection:
        """A fresh connection (each case opens its own: a refused case closes it)."""
        if self.url.startswith("unix:"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            sock.connect(self.url.removeprefix("unix:"))
            return Connection(sock)
        parts = urlsplit(self.url)
        default = 443 if parts.scheme == "https" else 80
        plain = socket.create_connection(
            (parts.hostname, parts.port or default), timeout=self.timeout
        )
        if parts.scheme == "https":
            context = ssl.create_default_context(cafile=self.tls_ca)
            return Connection(context.wrap_socket(plain, server_hostname=parts.hostname))
        return Connection(plain)


@dataclass(slots=True)
class Response:
    """One response as read off the wire (header names lowercased, values as sent)."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes
    interim: list[int] = field(default_factory=list)  # 1xx statuses seen before it

    def header(self, name: str) -> str | None:
        values = self.all(name)
        return values[0] if values else None

    def all(self, name: str) -> list[str]:
        return [value for key, value in self.headers if key == name]

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            raise CheckFailed(f"{self.status} body is not JSON: {self.body[:120]!r}") from None

    def summary(self) -> str:
        error = ""
        if self.status >= 400 and self.body.startswith(b"{"):
            try:
                detail = json.loads(self.body)["error"]
                error = f" {detail.get('code')}"
            except (ValueError, KeyError, TypeError):
                error = ""
        return f"{self.status}{error}"


class Connection:
    """One client connection to the server under test."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            # A server may answer and close before reading all we send (an
            # early error): the answer is still readable, so this is not fatal.
            if not isinstance(exc, (BrokenPipeError, ConnectionResetError)):
                raise

    def exchange(self, request: bytes) -> Response:
        self.send(request)
        return self.read_response()

    def read_response(self, *, stop_at_interim: bool = False) -> Response:
        """The next final response (1xx ones are noted in ``interim``).

        With ``stop_at_interim`` a 1xx response is returned as soon as it
        arrives (for ``Expect: 100-continue``).
        """
        interim: list[int] = []
        while True:
            status, headers = self._read_head()
            if 100 <= status < 200:
                interim.append(status)
                if stop_at_interim:
                    return Response(status, headers, b"", interim)
                continue
            return Response(status, headers, self._read_body(status, headers), interim)

    def _fill(self) -> None:
        try:
            data = self._sock.recv(_READ)
        except TimeoutError:
            raise CheckFailed("no answer within the timeout") from None
        except ConnectionResetError:
            data = b""
        if not data:
            raise CheckFailed("the server closed the connection without a complete answer")
        self._buffer += data

    def _read_head(self) -> tuple[int, list[tuple[str, str]]]:
        while (end := self._buffer.find(b"\r\n\r\n")) < 0:
            if len(self._buffer) > _MAX_HEAD:
                raise CheckFailed(f"response head over {_MAX_HEAD} bytes")
            self._fill()
        head = bytes(self._buffer[:end]).decode("latin-1")
        del self._buffer[: end + 4]
        lines = head.split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise CheckFailed(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        headers = []
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise CheckFailed(f"malformed response header line {line[:80]!r}")
            headers.append((name.strip().lower(), value.strip(" \t")))
        return int(parts[1]), headers

    def _read_body(self, status: int, headers: list[tuple[str, str]]) -> bytes:
        lengths = [value for name, value in headers if name == "content-length"]
        if status == 204 or status == 304:
            return b""
        if any(name == "transfer-encoding" for name, _ in headers):
            raise CheckFailed(f"{status} response is chunked; wire 2 answers carry Content-Length")
        if len(lengths) != 1 or not lengths[0].isdigit():
            raise CheckFailed(f"{status} response without one valid Content-Length: {lengths}")
        length = int(lengths[0])
        if length > _MAX_BODY:
            raise CheckFailed(f"{status} response announces {length} bytes, over the checker's cap")
        while len(self._buffer) < length:
            self._fill()
        body = bytes(self._buffer[:length])
        del self._buffer[:length]
        return body


def build_request(
    method: str,
    path: str,
    target: Target,
    headers: Iterable[tuple[str, str]] = (),
    body: bytes = b"",
    *,
    token: str | None = None,
    content_length: bool = True,
    extra: Sequence[tuple[str, str]] = (),
) -> bytes:
    """The exact request bytes: request line, Host, headers in order, body.

    ``Authorization`` is added when ``token`` is set; ``Content-Length`` when
    ``content_length`` is true and the method sends a body.
    """
    lines = [f"{method} {path} HTTP/1.1", f"Host: {target.host_header}"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    lines += [f"{name}: {value}" for name, value in (*headers, *extra)]
    if content_length and (body or method == "POST"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8") + body
