"""The heads of a server's answers, as pure functions: what an answer's
caller may set, what the connection adds, and the checks that keep us from
sending what our own peer would refuse.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from http import HTTPStatus

import h11

from ._body import Body, as_byte_buffer
from ._codec import body_bound
from ._errors import MeshnetError, error_body
from ._headers import WireHeaders

__all__ = [
    "Pairs",
    "activation_pairs",
    "caller_headers",
    "check_stream_status",
    "error_answer",
    "h11_response",
    "response_pairs",
]

Pairs = list[tuple[bytes | str, bytes | str]]

_FRAMING_HEADERS = (b"content-length", b"transfer-encoding", b"connection")


def caller_headers(headers: Iterable[tuple[bytes | str, bytes | str]]) -> Pairs:
    """An answer's own headers, as a list; the framing ones are the
    connection's to set, so passing one is a ``ValueError``."""
    pairs = list(headers)
    for name, _ in pairs:
        lowered = (name.encode() if isinstance(name, str) else name).lower()
        if lowered in _FRAMING_HEADERS:
            raise ValueError(f"{lowered.decode()} is set by the connection")
    return pairs


@functools.cache  # a handful of statuses; HTTPStatus(...) is an enum lookup per answer
def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


def h11_response(status: int, pairs: Pairs) -> h11.Response:
    """h11's response head; a header it refuses is a ``ValueError``."""
    try:
        return h11.Response(
            status_code=status,
            # h11 normalises each name and value by itself (bytes or
            # ASCII str); its annotation only lists unmixed lists.
            headers=pairs,  # type: ignore[arg-type]
            reason=_reason(status),
        )
    except h11.LocalProtocolError as exc:
        raise ValueError(f"not a valid response: {exc}") from None


def activation_pairs(headers: WireHeaders, body: Body) -> tuple[Pairs, Body]:
    """A ``200``'s headers for a wire-2 body, and the body as bytes (`as_byte_buffer`)."""
    if not isinstance(headers, WireHeaders):
        raise TypeError("headers must be a WireHeaders")
    data = as_byte_buffer(body)
    nbytes = len(data)
    # Never send what our own peer would refuse as garbage.
    if headers.encoding == "identity" and nbytes != headers.nbytes:
        raise ValueError(f"identity body of {nbytes} bytes, headers promise {headers.nbytes}")
    if nbytes > body_bound(headers):
        raise ValueError(f"body of {nbytes} bytes over its bound {body_bound(headers)}")
    return [*headers.to_pairs(), (b"Content-Length", str(nbytes).encode())], data


def response_pairs(
    status: int, headers: Iterable[tuple[bytes | str, bytes | str]], body: Body
) -> tuple[Pairs, Body]:
    """Any final answer's headers, ``Content-Length`` added where it has a
    body, and the body as bytes (`as_byte_buffer`)."""
    if not isinstance(status, int) or not 200 <= status <= 599:
        raise ValueError(f"status must be a final status 200..599, got {status!r}")
    data = as_byte_buffer(body)
    pairs = caller_headers(headers)
    if status in (204, 304):
        if len(data):
            raise ValueError(f"a {status} answer has no body")
    else:
        pairs.append((b"Content-Length", str(len(data)).encode()))
    return pairs, data


def error_answer(error: MeshnetError) -> tuple[Pairs, bytes]:
    """The wire-2 §4 answer's headers and JSON body for ``error``."""
    if not isinstance(error, MeshnetError):
        raise TypeError("error must be a MeshnetError")
    body = error_body(error)
    pairs: Pairs = [
        (b"Content-Type", b"application/json"),
        (b"Content-Length", str(len(body)).encode()),
    ]
    if error.retry_after is not None:
        pairs.append((b"Retry-After", str(int(error.retry_after)).encode()))
    if error.status == 401:
        pairs.append((b"WWW-Authenticate", b"Bearer"))
    return pairs, body


def check_stream_status(status: int) -> None:
    if not isinstance(status, int) or not 200 <= status <= 599 or status in (204, 304):
        raise ValueError(f"a streamed answer needs a status with a body, got {status!r}")
