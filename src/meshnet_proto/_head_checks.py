"""The checks a request head goes through before its body is read, as pure
functions: each takes what it checks and returns it (or what it means), or
raises the wire-2 §4 `ProtocolError` its answer is.

wire-2 §2 order, as `ServerConnection` applies them: the head itself (size,
HTTP version), credentials (wire-2 §7), path and method (404/405, wire-2 §6),
framing (the rules h11 leaves to us), and for an activation the body's size
against what its wire headers promise.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

import h11

from ._codec import body_bound
from ._errors import ErrorCode, ProtocolError
from ._headers import WireHeaders
from ._limits import Limits

__all__ = [
    "activation_body_size",
    "check_activation_length",
    "check_framing",
    "check_head",
    "check_route",
    "endpoint_body_too_large",
    "from_h11",
    "is_preflight",
]

_HTTP_VERSIONS = frozenset({b"1.0", b"1.1"})


def from_h11(exc: h11.RemoteProtocolError, limits: Limits) -> ProtocolError:
    """Turn h11's complaint into a wire-2 §4 error.

    h11 signals 431 for an oversized head and 501 for a transfer coding it
    cannot read; wire 2 makes the latter a 400 (smuggling, wire-2 §2). A
    conflicting or malformed ``Content-Length`` is framing too. Everything
    else is HTTP the parser cannot read. h11's message is cut at its first
    colon, because what follows it is the offending input quoted back.
    """
    reason = str(exc).split(":", 1)[0].strip() or "unreadable request"
    if exc.error_status_hint == 431:
        return _head_too_large(limits)
    if exc.error_status_hint == 501 or "content-length" in reason.lower():
        return ProtocolError(f"bad request framing ({reason})", code=ErrorCode.BAD_FRAMING)
    return ProtocolError(f"malformed HTTP request ({reason})", code=ErrorCode.MALFORMED_REQUEST)


def _head_too_large(limits: Limits) -> ProtocolError:
    return ProtocolError(
        f"request head over {limits.max_header_bytes} bytes",
        code=ErrorCode.HEADER_BLOCK_TOO_LARGE,
    )


def check_head(
    request: h11.Request, headers: Sequence[tuple[bytes, bytes]], limits: Limits
) -> None:
    """The head as a whole (``headers``: its header pairs, as h11 gives them):
    within the header limit, and HTTP/1.x."""
    # The head's size as sent, less optional whitespace h11 stripped:
    # "METHOD SP target SP HTTP/x.y CRLF", "name: value CRLF" each, CRLF.
    size = len(request.method) + len(request.target) + 12
    for name, value in headers:
        size += len(name) + len(value) + 4
    if size + 2 > limits.max_header_bytes:
        raise _head_too_large(limits)
    # h11 reads any "HTTP/d.d" and would serve "HTTP/2.0" or "HTTP/0.9" as
    # if it were 1.1; wire 2 is HTTP/1.1 (1.0 is its subset, RFC 9112).
    if request.http_version not in _HTTP_VERSIONS:
        raise ProtocolError(
            f"HTTP/{request.http_version.decode('ascii')} is not spoken here; wire 2 is HTTP/1.1",
            code=ErrorCode.MALFORMED_REQUEST,
        )


def is_preflight(method: str, path: str, routes: Mapping[str, Collection[str]]) -> bool:
    """A CORS preflight a route answers (``OPTIONS`` among its methods):
    browsers send it without credentials, and its answer names only the
    methods and headers allowed (wire-2 §7), so it needs none."""
    return method == "OPTIONS" and any(
        "OPTIONS" in methods and _route_matches(pattern, path)
        for pattern, methods in routes.items()
    )


def _route_matches(pattern: str, path: str) -> bool:
    # A key ending in "/*" matches exactly one non-empty path segment there;
    # one ending in "/**" any non-empty rest (a surface that answers every
    # path under its prefix itself, as the gateway's OpenAI 404s).
    if pattern.endswith("/**"):
        prefix = pattern[:-2]
        return path.startswith(prefix) and len(path) > len(prefix)
    if pattern.endswith("/*"):
        prefix = pattern[:-1]
        rest = path[len(prefix) :]
        return path.startswith(prefix) and rest != "" and "/" not in rest
    return pattern == path


def check_route(
    method: str, path: str, activation_path: str, routes: Mapping[str, Collection[str]]
) -> str | None:
    """The route-table key ``path`` falls under, None for the activation
    path; 404 for a path that is neither, 405 for a method it does not take."""
    allowed: Collection[str] = ("POST",)
    route = None
    if path != activation_path:
        route = next((pattern for pattern in routes if _route_matches(pattern, path)), None)
        if route is None:
            raise ProtocolError(f"no such path: {path[:200]}", code=ErrorCode.NOT_FOUND)
        allowed = routes[route]
    if method not in allowed:
        raise ProtocolError(
            f"{method} is not allowed on {path[:200]} (allowed: {', '.join(sorted(allowed))})",
            code=ErrorCode.METHOD_NOT_ALLOWED,
        )
    return route


def check_framing(method: str, headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    """The request's Content-Length (None when chunked or bodyless)."""
    # h11 has already refused a transfer coding other than chunked, two
    # Transfer-Encoding headers and conflicting Content-Lengths; what it
    # allows but wire 2 forbids is both at once (TE would silently win).
    lengths: list[bytes] = []
    chunked = False
    for name, value in headers:  # one pass, no generator: every request comes here
        if name == b"content-length":
            lengths.append(value)
        elif name == b"transfer-encoding":
            chunked = True
    if lengths and chunked:
        raise ProtocolError(
            "Content-Length together with Transfer-Encoding",
            code=ErrorCode.BAD_FRAMING,
            header="transfer-encoding",
        )
    if not lengths and not chunked and method == "POST":
        raise ProtocolError(
            "a POST needs Content-Length or Transfer-Encoding: chunked",
            code=ErrorCode.LENGTH_REQUIRED,
        )
    return int(lengths[0]) if lengths else None


def endpoint_body_too_large(max_endpoint_body: int) -> ProtocolError:
    return ProtocolError(
        f"request body over {max_endpoint_body} bytes",
        code=ErrorCode.BODY_TOO_LARGE,
    )


def check_activation_length(wire: WireHeaders, content_length: int | None) -> None:
    """413 when the Content-Length is over the body's bound."""
    bound = body_bound(wire)
    if content_length is not None and content_length > bound:
        raise ProtocolError(
            f"Content-Length {content_length} over the body bound {bound} "
            f"of a {wire.encoding} {wire.dtype} tensor of shape {wire.shape}",
            code=ErrorCode.BODY_TOO_LARGE,
            header="content-length",
        )


def activation_body_size(wire: WireHeaders, content_length: int | None) -> int:
    """The buffer an activation's body needs: its Content-Length, or for a
    chunked body room for the largest acceptable one (`BodyReader.add`
    refuses anything beyond it). A short identity body is refused here,
    before a byte of it is read (over the bound was refused with the head)."""
    if content_length is None:
        return body_bound(wire)
    if wire.encoding == "identity" and content_length != wire.nbytes:
        raise ProtocolError(
            f"Content-Length {content_length} is not the {wire.nbytes} bytes the headers promise",
            code=ErrorCode.BODY_SIZE_MISMATCH,
            header="content-length",
        )
    return content_length
