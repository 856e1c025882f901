"""`ServerConnection`: the server side of one HTTP/1.1 connection, sans IO.

It wraps ``h11.Connection(h11.SERVER)`` and adds what wire 2 needs on top of
HTTP: wire-2 §7 credentials, routing (404/405), the framing rules h11 leaves
to us (``Content-Length`` *and* ``Transfer-Encoding`` is smuggling; a POST
with neither is 411), the wire headers (`parse_wire_headers`), a body held to
its bound while it streams into one preallocated buffer, and the decode.

The connection runs a small state machine of its own (`_Phase`, with its
transitions in the `_TRANSITIONS` table) over h11's: one request/response
cycle after another on the same connection, restarted automatically once a
response has gone out and both sides are done. Errors are sticky: after a
`ProtocolErrorReceived` the only thing left to do is ``send_error()`` and
close.
"""

from __future__ import annotations

import enum
import functools
import hmac
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from http import HTTPStatus

import h11
import numpy as np
import zstandard

from ._body_bypass import take_body_bytes
from ._codec import body_bound, decode_tensor
from ._errors import MeshnetError, ProtocolError, error_body
from ._events import (
    NEED_DATA,
    PAUSED,
    ActivationHead,
    ActivationReceived,
    ConnectionClosed,
    EndpointRequest,
    NeedData,
    Paused,
    ProtocolErrorReceived,
)
from ._headers import WireHeaders, parse_wire_headers
from ._limits import KiB, Limits
from ._topology import is_deep_health

__all__ = ["DEFAULT_MAX_ENDPOINT_BODY", "DEFAULT_ROUTES", "ServerConnection"]

# wire-2 §6. A key ending in "/*" matches exactly one non-empty path segment in
# its place, which is all `DELETE /sessions/{id}` needs.
DEFAULT_ROUTES: Mapping[str, Collection[str]] = {
    "/health": ("GET",),
    "/info": ("GET",),
    "/metrics": ("GET",),
    "/sessions/*": ("DELETE",),
}

# The control endpoints take at most a few hundred bytes of JSON; 64 KiB
# leaves room for growth while keeping an unauthenticated (/health) or
# hostile body from costing anything.
DEFAULT_MAX_ENDPOINT_BODY = 64 * KiB

Body = bytes | bytearray | memoryview
Output = list[bytes | bytearray | memoryview]


class _Phase(enum.Enum):
    IDLE = "idle"  # waiting for (the rest of) a request head
    HEAD_DELIVERED = "head delivered"  # ActivationHead returned, body unread
    ACTIVATION_BODY = "activation body"  # reading the tensor body
    ENDPOINT_BODY = "endpoint body"  # reading a small control body
    RESPONDING = "responding"  # request complete: the driver's turn to answer
    STREAMING = "streaming"  # a streamed answer's head went out, its body follows
    ERROR = "error"  # ProtocolErrorReceived returned: answer, then close
    CLOSED = "closed"  # nothing more will be read; close the transport


class _Trigger(enum.Enum):
    ACTIVATION_HEAD = "activation head"
    ENDPOINT_HEAD = "endpoint head"
    READ_BODY = "read body"
    REQUEST_COMPLETE = "request complete"
    PROTOCOL_ERROR = "protocol error"
    PEER_CLOSED = "peer closed"
    STREAM_STARTED = "stream started"
    ANSWERED_KEEP_ALIVE = "answered, keep-alive"
    ANSWERED_CLOSE = "answered, close"


_P, _T = _Phase, _Trigger
# (phase, trigger) -> next phase. Anything absent is a bug in this module or
# a driver calling out of turn; `_move` says which.
_TRANSITIONS: dict[tuple[_Phase, _Trigger], _Phase] = {
    (_P.IDLE, _T.ACTIVATION_HEAD): _P.HEAD_DELIVERED,
    (_P.IDLE, _T.ENDPOINT_HEAD): _P.ENDPOINT_BODY,
    (_P.HEAD_DELIVERED, _T.READ_BODY): _P.ACTIVATION_BODY,
    (_P.ACTIVATION_BODY, _T.REQUEST_COMPLETE): _P.RESPONDING,
    (_P.ENDPOINT_BODY, _T.REQUEST_COMPLETE): _P.RESPONDING,
    (_P.RESPONDING, _T.ANSWERED_KEEP_ALIVE): _P.IDLE,
    (_P.RESPONDING, _T.STREAM_STARTED): _P.STREAMING,
    (_P.STREAMING, _T.ANSWERED_KEEP_ALIVE): _P.IDLE,
    **{
        (phase, _T.PROTOCOL_ERROR): _P.ERROR
        for phase in (_P.IDLE, _P.HEAD_DELIVERED, _P.ACTIVATION_BODY, _P.ENDPOINT_BODY)
    },
    # h11 reports a close mid-request as an error, so only between requests
    # is it a plain close.
    (_P.IDLE, _T.PEER_CLOSED): _P.CLOSED,
    # Any answer that is not a keep-alive end of a complete exchange closes:
    # an early reject, an error, a timeout, or the client asked to close.
    **{
        (phase, _T.ANSWERED_CLOSE): _P.CLOSED
        for phase in (
            _P.IDLE,
            _P.HEAD_DELIVERED,
            _P.ACTIVATION_BODY,
            _P.ENDPOINT_BODY,
            _P.RESPONDING,
            _P.STREAMING,
            _P.ERROR,
        )
    },
}


def body_buffer(size: int) -> bytearray | memoryview:
    """A writable buffer of ``size`` bytes that commits memory only as it is
    written.

    ``bytearray(size)`` zero-fills, so a head promising a 512 MiB tensor would
    commit 512 MiB before a byte of body arrives (and keep it for the body
    timeout). From `_LAZY_BUFFER_BYTES` on, the buffer is uninitialised memory
    from ``numpy.empty``: the allocator hands out untouched pages (committed
    when written) or reuses memory the process already holds, and never
    writes it first. An anonymous ``mmap`` commits as written too, but every
    page of a fresh mapping is a fault and a kernel zero-fill: filling 16 MiB
    took 16-19 ms against ~2 ms, on each side of every hop
    (meshnet bench, section hop). Growing a bytearray by appending commits as
    written as well, but its reallocations copy (up to twice the body held at
    once, and quadratic time when the allocator cannot grow in place).
    """
    if size < _LAZY_BUFFER_BYTES:
        return bytearray(size)
    return np.empty(size, dtype=np.uint8).data


_LAZY_BUFFER_BYTES = 256 * KiB


@dataclass(slots=True)
class _BodyReader:
    """One request body being collected into one preallocated buffer
    (`body_buffer`); an endpoint's chunked body grows a bytearray."""

    buffer: bytearray | memoryview
    limit: int  # bytes the body may have; over it is 413
    filled: int = 0

    def add(self, data: bytes | bytearray | memoryview) -> None:
        end = self.filled + len(data)
        if end > self.limit:
            raise ProtocolError(
                f"request body over its bound of {self.limit} bytes",
                code="body_too_large",
                status=413,
            )
        # Only an endpoint's chunked body (a bytearray) grows past its
        # buffer, to at most `limit`; slice assignment extends it.
        self.buffer[self.filled : end] = data
        self.filled = end

    def view(self) -> memoryview:
        return memoryview(self.buffer)[: self.filled]


_HTTP_VERSIONS = frozenset({b"1.0", b"1.1"})


def _unauthorized() -> ProtocolError:
    # A fixed message: never a hint of the token, nor of what was sent.
    return ProtocolError(
        "missing or wrong Authorization: Bearer credentials",
        code="unauthorized",
        status=401,
        header="authorization",
    )


def _from_h11(exc: h11.RemoteProtocolError, limits: Limits) -> ProtocolError:
    """Turn h11's complaint into a wire-2 §4 error.

    h11 signals 431 for an oversized head and 501 for a transfer coding it
    cannot read; wire 2 makes the latter a 400 (smuggling, wire-2 §2). A
    conflicting or malformed ``Content-Length`` is framing too. Everything
    else is HTTP the parser cannot read. h11's message is cut at its first
    colon, because what follows it is the offending input quoted back.
    """
    reason = str(exc).split(":", 1)[0].strip() or "unreadable request"
    if exc.error_status_hint == 431:
        return ProtocolError(
            f"request head over {limits.max_header_bytes} bytes",
            code="header_block_too_large",
            status=431,
        )
    if exc.error_status_hint == 501 or "content-length" in reason.lower():
        return ProtocolError(f"bad request framing ({reason})", code="bad_framing")
    return ProtocolError(f"malformed HTTP request ({reason})", code="malformed_request")


def _head_size(request: h11.Request) -> int:
    # The head's size as sent, less optional whitespace h11 stripped:
    # "METHOD SP target SP HTTP/x.y CRLF", "name: value CRLF" each, CRLF.
    size = len(request.method) + len(request.target) + 12
    for name, value in request.headers:
        size += len(name) + len(value) + 4
    return size + 2


def _route_matches(pattern: str, path: str) -> bool:
    if pattern.endswith("/*"):
        prefix = pattern[:-1]
        rest = path[len(prefix) :]
        return path.startswith(prefix) and rest != "" and "/" not in rest
    return pattern == path


class ServerConnection:
    """The server side of one connection: bytes in, events out; answers in,
    bytes out. See ``docs/embedding.md`` for the driver loop.

    ``token``: when set, every path but a plain ``/health`` (``?deep=1``
    included) needs ``Authorization: Bearer <token>`` (wire-2 §7). ``activation_path`` takes
    ``POST`` only. ``routes`` are the other paths and their methods (404 and
    405 come from here). ``require_sequencing=False`` is the gateway's input
    (session, index and total optional). ``max_endpoint_body`` caps the body
    of any request that is not an activation. ``decompressor`` is handed to
    `decode_tensor` (one per thread, if the driver decodes in threads).
    """

    def __init__(
        self,
        *,
        limits: Limits = Limits(),  # noqa: B008 - frozen, shared safely
        token: str | None = None,
        activation_path: str = "/forward",
        require_sequencing: bool = True,
        routes: Mapping[str, Collection[str]] = DEFAULT_ROUTES,
        max_endpoint_body: int = DEFAULT_MAX_ENDPOINT_BODY,
        decompressor: zstandard.ZstdDecompressor | None = None,
    ) -> None:
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError("token must be a non-empty str or None")
        if not activation_path.startswith("/"):
            raise ValueError("activation_path must start with '/'")
        if max_endpoint_body < 0:
            raise ValueError("max_endpoint_body must be >= 0")
        self._limits = limits
        self._token = token.encode() if token is not None else None
        self._activation_path = activation_path
        self._require_sequencing = require_sequencing
        self._routes = {pattern: frozenset(methods) for pattern, methods in routes.items()}
        self._max_endpoint_body = max_endpoint_body
        self._decompressor = decompressor
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        # True from h11's NEED_DATA until bytes are fed to it: it holds none.
        self._h11_drained = False
        self._phase = _Phase.IDLE
        self._needs_drain = False
        # An answer to HEAD carries the headers of a GET's and no body (h11
        # would refuse one): remembered until the answer goes out.
        self._answering_head = False
        self._reset_cycle()

    # ------------------------------------------------------------- state

    def _reset_cycle(self) -> None:
        self._wire: WireHeaders | None = None
        self._query = ""  # the activation's query string (``/forward?replay=1``)
        self._content_length: int | None = None
        self._body: _BodyReader | None = None
        self._endpoint: tuple[str, str, str, str, tuple[tuple[bytes, bytes], ...]] | None = None

    def _move(self, trigger: _Trigger) -> None:
        try:
            self._phase = _TRANSITIONS[self._phase, trigger]
        except KeyError:  # pragma: no cover - a hole in the table is a bug here
            raise RuntimeError(
                f"ServerConnection: cannot handle {trigger.value!r} in phase {self._phase.value!r}"
            ) from None

    @property
    def should_close(self) -> bool:
        """True once the transport must be closed: after an error, after an
        answer with ``Connection: close``, or when the peer has closed."""
        return self._phase in (_Phase.ERROR, _Phase.CLOSED) or self._h11.our_state in (
            h11.MUST_CLOSE,
            h11.CLOSED,
            h11.ERROR,
        )

    @property
    def reading_body(self) -> bool:
        """True once a request's head is accepted and its body is being read.

        From then on a driver times the body (its body timeout), not the
        head: an endpoint's request comes out whole, so without this the
        driver could not tell a slow head from a slow body (wire-2 §2.6).
        """
        return self._phase in (_Phase.ACTIVATION_BODY, _Phase.ENDPOINT_BODY)

    @property
    def needs_drain(self) -> bool:
        """True when an answer went out before the request was fully read.

        Closing a socket with unread input makes the kernel send a reset,
        which can destroy the answer in flight; the driver should read and
        discard what the client still sends (briefly: e.g. up to 64 KiB or
        1 s), then close.
        """
        return self._needs_drain

    # ------------------------------------------------------------- input

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer bytes from the transport; ``b""`` means end of stream.

        Bytes of a tensor body go straight into its buffer when h11 has
        nothing unread (`_body_bypass`); the rest, and everything else, to h11.
        """
        body = self._body
        if (
            data
            and self._h11_drained
            and body is not None
            and self._phase is _Phase.ACTIVATION_BODY
        ):
            data = take_body_bytes(self._h11, data, body.add)
            if not data:
                return
        self._h11_drained = False
        self._h11.receive_data(data)  # type: ignore[arg-type]  # any bytes-like

    def next_event(
        self,
    ) -> (
        ActivationHead
        | ActivationReceived
        | EndpointRequest
        | ProtocolErrorReceived
        | ConnectionClosed
        | NeedData
        | Paused
    ):
        """The next event, `NEED_DATA` (feed more bytes) or `PAUSED` (the
        request is complete: answer it).

        Never raises for anything the peer sends: bad input comes back as
        `ProtocolErrorReceived`, once; after it (and after any closing
        answer) every call returns `ConnectionClosed`.
        """
        if self._phase in (_Phase.ERROR, _Phase.CLOSED):
            return ConnectionClosed()
        if self._phase is _Phase.RESPONDING:
            return PAUSED
        try:
            if self._phase is _Phase.HEAD_DELIVERED:
                self._start_activation_body()
            while True:
                event = self._h11.next_event()
                if event is h11.NEED_DATA:
                    self._h11_drained = True  # h11 holds no unread byte now
                    return NEED_DATA
                result = self._handle(event)
                if result is not None:
                    return result
        except h11.RemoteProtocolError as exc:
            return self._fail(_from_h11(exc, self._limits))
        except MeshnetError as exc:
            return self._fail(exc)

    def _fail(self, error: MeshnetError) -> ProtocolErrorReceived:
        self._move(_Trigger.PROTOCOL_ERROR)
        self._reset_cycle()
        return ProtocolErrorReceived(error=error)

    def _handle(
        self, event: object
    ) -> ActivationHead | ActivationReceived | EndpointRequest | ConnectionClosed | None:
        if isinstance(event, h11.Request):
            return self._on_head(event)
        if isinstance(event, h11.Data):
            assert self._body is not None
            self._body.add(event.data)
            return None
        if isinstance(event, h11.EndOfMessage):
            return self._on_end()
        # h11 yields nothing else from a client but ConnectionClosed (PAUSED
        # cannot happen: we never ask h11 while RESPONDING).
        assert isinstance(event, h11.ConnectionClosed), event
        self._move(_Trigger.PEER_CLOSED)
        return ConnectionClosed()

    def _on_head(self, request: h11.Request) -> ActivationHead | None:
        self._answering_head = request.method == b"HEAD"
        if _head_size(request) > self._limits.max_header_bytes:
            raise ProtocolError(
                f"request head over {self._limits.max_header_bytes} bytes",
                code="header_block_too_large",
                status=431,
            )
        # h11 reads any "HTTP/d.d" and would serve "HTTP/2.0" or "HTTP/0.9" as
        # if it were 1.1; wire 2 is HTTP/1.1 (1.0 is its subset, RFC 9112).
        if request.http_version not in _HTTP_VERSIONS:
            raise ProtocolError(
                f"HTTP/{request.http_version.decode('ascii')} is not spoken here; "
                "wire 2 is HTTP/1.1",
                code="malformed_request",
            )
        # h11 has validated both as visible ASCII.
        method = request.method.decode("ascii")
        path, _, query = request.target.decode("ascii").partition("?")
        headers = tuple(request.headers)

        # wire-2 §2 order: credentials, path/method, framing, wire headers.
        # /health stays open (a load balancer's probe); ?deep=1 shows the
        # chain's URLs and identities and costs every hop: it needs the token.
        if self._token is not None and (path != "/health" or is_deep_health(query)):
            self._check_credentials(headers)
        is_activation = path == self._activation_path
        route = None if is_activation else self._route(path)
        allowed = {"POST"} if is_activation else self._routes.get(route)  # type: ignore[arg-type]
        if allowed is None:
            raise ProtocolError(f"no such path: {path[:200]}", code="not_found", status=404)
        if method not in allowed:
            raise ProtocolError(
                f"{method} is not allowed on {path[:200]} (allowed: {', '.join(sorted(allowed))})",
                code="method_not_allowed",
                status=405,
            )
        content_length = self._check_framing(method, headers)

        if not is_activation:
            if content_length is not None and content_length > self._max_endpoint_body:
                raise self._endpoint_body_too_large()
            assert route is not None
            self._endpoint = (method, route, path, query, headers)
            initial = content_length if content_length is not None else 0
            self._body = _BodyReader(bytearray(initial), self._max_endpoint_body)
            self._move(_Trigger.ENDPOINT_HEAD)
            return None

        wire = parse_wire_headers(
            headers, limits=self._limits, require_sequencing=self._require_sequencing
        )
        bound = body_bound(wire)
        if content_length is not None and content_length > bound:
            raise ProtocolError(
                f"Content-Length {content_length} over the body bound {bound} "
                f"of a {wire.encoding} {wire.dtype} tensor of shape {wire.shape}",
                code="body_too_large",
                status=413,
                header="content-length",
            )
        self._wire = wire
        self._query = query
        self._content_length = content_length
        self._move(_Trigger.ACTIVATION_HEAD)
        return ActivationHead(
            headers=wire,
            expects_continue=self._h11.they_are_waiting_for_100_continue,
            query=query,
        )

    def _check_credentials(self, headers: tuple[tuple[bytes, bytes], ...]) -> None:
        assert self._token is not None
        values = [value for name, value in headers if name == b"authorization"]
        if len(values) != 1:
            raise _unauthorized()
        scheme, _, credentials = values[0].partition(b" ")
        # compare_digest runs in time independent of where the bytes differ;
        # run it even for a wrong scheme so that branch costs the same.
        matches = hmac.compare_digest(credentials.strip(), self._token)
        if scheme.lower() != b"bearer" or not matches:
            raise _unauthorized()

    def _route(self, path: str) -> str | None:
        """The route-table key ``path`` falls under, or None."""
        for pattern in self._routes:
            if _route_matches(pattern, path):
                return pattern
        return None

    def _check_framing(self, method: str, headers: Iterable[tuple[bytes, bytes]]) -> int | None:
        # h11 has already refused a transfer coding other than chunked, two
        # Transfer-Encoding headers and conflicting Content-Lengths; what it
        # allows but wire 2 forbids is both at once (TE would silently win).
        lengths = [value for name, value in headers if name == b"content-length"]
        chunked = any(name == b"transfer-encoding" for name, _ in headers)
        if lengths and chunked:
            raise ProtocolError(
                "Content-Length together with Transfer-Encoding",
                code="bad_framing",
                header="transfer-encoding",
            )
        if not lengths and not chunked and method == "POST":
            raise ProtocolError(
                "a POST needs Content-Length or Transfer-Encoding: chunked",
                code="length_required",
                status=411,
            )
        return int(lengths[0]) if lengths else None

    def _endpoint_body_too_large(self) -> ProtocolError:
        return ProtocolError(
            f"request body over {self._max_endpoint_body} bytes",
            code="body_too_large",
            status=413,
        )

    def _start_activation_body(self) -> None:
        wire = self._wire
        assert wire is not None
        self._move(_Trigger.READ_BODY)
        length = self._content_length
        if length is None:
            # Chunked: room for the largest acceptable body, and not a byte
            # more; `_BodyReader.add` refuses anything beyond it.
            size = body_bound(wire)
        elif wire.encoding == "identity" and length != wire.nbytes:
            # Over the bound was refused with the head; short is known now,
            # before reading a byte of it.
            raise ProtocolError(
                f"Content-Length {length} is not the {wire.nbytes} bytes the headers promise",
                code="body_size_mismatch",
                header="content-length",
            )
        else:
            size = length
        self._body = _BodyReader(body_buffer(size), size)

    def _on_end(self) -> ActivationReceived | EndpointRequest:
        body = self._body
        assert body is not None
        if self._phase is _Phase.ENDPOINT_BODY:
            assert self._endpoint is not None
            method, route, path, query, headers = self._endpoint
            event: ActivationReceived | EndpointRequest = EndpointRequest(
                method=method,
                path=path,
                query=query,
                headers=headers,
                body=bytes(body.view()),
                route=route,
            )
        else:
            wire = self._wire
            assert wire is not None
            tensor: np.ndarray = decode_tensor(
                wire, body.view(), limits=self._limits, decompressor=self._decompressor
            )
            event = ActivationReceived(
                headers=wire, tensor=tensor, body_nbytes=body.filled, query=self._query
            )
        self._move(_Trigger.REQUEST_COMPLETE)
        self._reset_cycle()
        return event

    # ------------------------------------------------------------- output

    def send_continue(self) -> bytes:
        """``100 Continue`` when the client waits for it, else ``b""``.

        Write it before reading a body whose head said
        ``expects_continue``; never write it when rejecting early.
        """
        if not self._h11.they_are_waiting_for_100_continue:
            return b""
        return self._send(
            h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
        )

    def send_interim(self) -> bytes:
        """An unsolicited ``100 Continue`` while a complete request awaits its
        answer, else ``b""`` (an answer has begun, or no request is complete).

        RFC 9110 §15.2 lets a server send interim answers before the final
        one and obliges every client to skip them. A driver uses one as a
        probe: after a client half-closed, only a write tells a client that
        still reads from one whose socket is gone (it answers with a reset).
        """
        if self._h11.our_state is not h11.SEND_RESPONSE or self._h11.their_state is not h11.DONE:
            return b""
        return self._send(
            h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
        )

    def send_activation(self, headers: WireHeaders, body: Body) -> Output:
        """``200`` with ``headers.to_pairs()`` and ``Content-Length``.

        The returned list holds the head's bytes and then ``body`` itself —
        the very object passed (cast to bytes when it is a memoryview of
        another format), never a copy: write the pieces in order.
        """
        if not isinstance(headers, WireHeaders):
            raise TypeError("headers must be a WireHeaders")
        data = _as_byte_buffer(body)
        nbytes = len(data)
        # Never send what our own peer would refuse as garbage.
        if headers.encoding == "identity" and nbytes != headers.nbytes:
            raise ValueError(f"identity body of {nbytes} bytes, headers promise {headers.nbytes}")
        if nbytes > body_bound(headers):
            raise ValueError(f"body of {nbytes} bytes over its bound {body_bound(headers)}")
        pairs: list[tuple[bytes | str, bytes | str]] = [
            *headers.to_pairs(),
            (b"Content-Length", str(nbytes).encode()),
        ]
        return self._respond(200, pairs, data)

    def send_response(
        self,
        status: int,
        headers: Iterable[tuple[bytes | str, bytes | str]] = (),
        body: Body = b"",
    ) -> Output:
        """Any final answer (``/info``'s JSON, ``/metrics``' text, 204, …).

        ``Content-Length`` is added (not for 204/304, which have no body);
        don't pass ``Content-Length``, ``Transfer-Encoding`` or
        ``Connection`` yourself.
        """
        if not isinstance(status, int) or not 200 <= status <= 599:
            raise ValueError(f"status must be a final status 200..599, got {status!r}")
        data = _as_byte_buffer(body)
        pairs = _caller_headers(headers)
        if status in (204, 304):
            if len(data):
                raise ValueError(f"a {status} answer has no body")
        else:
            pairs.append((b"Content-Length", str(len(data)).encode()))
        return self._respond(status, pairs, data)

    def send_error(self, error: MeshnetError) -> Output:
        """The wire-2 §4 JSON answer for ``error``.

        Adds ``Retry-After`` when ``error.retry_after`` is set and
        ``WWW-Authenticate: Bearer`` on 401. Answering before the request
        was fully read (an early reject, a timeout, a protocol error) adds
        ``Connection: close``; see `needs_drain`.
        """
        if not isinstance(error, MeshnetError):
            raise TypeError("error must be a MeshnetError")
        body = error_body(error)
        pairs: list[tuple[bytes | str, bytes | str]] = [
            (b"Content-Type", b"application/json"),
            (b"Content-Length", str(len(body)).encode()),
        ]
        if error.retry_after is not None:
            pairs.append((b"Retry-After", str(int(error.retry_after)).encode()))
        if error.status == 401:
            pairs.append((b"WWW-Authenticate", b"Bearer"))
        return self._respond(error.status, pairs, body)

    def start_next_cycle(self) -> None:
        """Kept for drivers written against h11's habit; the connection
        restarts by itself once an answer to a complete request has gone out
        and the connection stays open, so this only checks that it did."""
        if self._phase is not _Phase.IDLE:
            raise RuntimeError(f"no finished exchange to restart (phase {self._phase.value!r})")

    def _respond(
        self, status: int, pairs: list[tuple[bytes | str, bytes | str]], data: Body
    ) -> Output:
        if self._phase is _Phase.CLOSED:
            raise RuntimeError("the connection is closed; nothing more can be sent")
        early = self._phase is not _Phase.RESPONDING
        if early:
            pairs.append((b"Connection", b"close"))
        # One bytes object for the head (one write, not one per header line),
        # then the body object itself, untouched.
        try:
            response = h11.Response(
                status_code=status,
                # h11 normalises each name and value by itself (bytes or
                # ASCII str); its annotation only lists unmixed lists.
                headers=pairs,  # type: ignore[arg-type]
                reason=_reason(status),
            )
        except h11.LocalProtocolError as exc:
            raise ValueError(f"not a valid response: {exc}") from None
        head = b"".join(self._send_pieces(response))
        out: Output = [head]
        if len(data) and not self._answering_head:
            # Sent by passthrough: h11 hands the object back untouched (no
            # copy), so any bytes-like works; its annotation says bytes.
            out += self._send_pieces(h11.Data(data=data))  # type: ignore[arg-type]
        # Content-Length framing: the end of the message writes nothing.
        self._send_pieces(h11.EndOfMessage())
        self._finish(early=early)
        return out

    def _finish(self, *, early: bool) -> None:
        """The answer is complete: keep the connection for the next request or close."""
        self._answering_head = False
        if early:
            # The request may still be streaming in; its bytes will never be
            # read as a request again.
            self._needs_drain = True
            self._move(_Trigger.ANSWERED_CLOSE)
        elif self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
            self._h11.start_next_cycle()
            self._move(_Trigger.ANSWERED_KEEP_ALIVE)
        else:
            # The client said Connection: close, or spoke HTTP/1.0.
            self._move(_Trigger.ANSWERED_CLOSE)

    # ------------------------------------------------------------- streamed answers

    def send_stream_start(
        self, status: int, headers: Iterable[tuple[bytes | str, bytes | str]] = ()
    ) -> bytes:
        """The head of an answer whose body is not known yet (server-sent events).

        Only after a complete request (`PAUSED`). The body follows in
        `send_stream_data` pieces and ends with `send_stream_end`; h11 frames
        it with ``Transfer-Encoding: chunked`` (HTTP/1.1) or by closing the
        connection (HTTP/1.0). Don't pass the framing headers yourself.
        """
        if self._phase is not _Phase.RESPONDING:
            raise RuntimeError(f"no complete request to answer (phase {self._phase.value!r})")
        if not isinstance(status, int) or not 200 <= status <= 599 or status in (204, 304):
            raise ValueError(f"a streamed answer needs a status with a body, got {status!r}")
        pairs = _caller_headers(headers)
        try:
            response = h11.Response(
                status_code=status,
                # h11 normalises each name and value by itself (bytes or
                # ASCII str); its annotation only lists unmixed lists.
                headers=pairs,  # type: ignore[arg-type]
                reason=_reason(status),
            )
        except h11.LocalProtocolError as exc:
            raise ValueError(f"not a valid response: {exc}") from None
        head = b"".join(self._send_pieces(response))
        self._move(_Trigger.STREAM_STARTED)
        return head

    def send_stream_data(self, data: Body) -> Output:
        """One piece of a streamed body (nothing for an empty piece or a HEAD)."""
        if self._phase is not _Phase.STREAMING:
            raise RuntimeError(f"no streamed answer in progress (phase {self._phase.value!r})")
        data = _as_byte_buffer(data)
        if not len(data) or self._answering_head:
            return []
        return self._send_pieces(h11.Data(data=data))  # type: ignore[arg-type]  # as in _respond

    def send_stream_end(self) -> Output:
        """End a streamed body: the closing chunk, then keep-alive or close."""
        if self._phase is not _Phase.STREAMING:
            raise RuntimeError(f"no streamed answer in progress (phase {self._phase.value!r})")
        out = self._send_pieces(h11.EndOfMessage())
        self._finish(early=False)
        return out

    def _send_pieces(
        self, event: h11.InformationalResponse | h11.Response | h11.Data | h11.EndOfMessage
    ) -> Output:
        try:
            pieces = self._h11.send_with_data_passthrough(event)
        except h11.LocalProtocolError as exc:  # pragma: no cover - `_respond` checks first
            # h11's own state check, behind ours: kept so that a gap in ours
            # surfaces as a driver-facing error, not as h11's internals.
            raise RuntimeError(f"cannot send this now: {exc}") from exc
        assert pieces is not None
        return list(pieces)

    def _send(self, event: h11.InformationalResponse) -> bytes:
        return b"".join(self._send_pieces(event))  # a head only: small


_FRAMING_HEADERS = (b"content-length", b"transfer-encoding", b"connection")


def _caller_headers(
    headers: Iterable[tuple[bytes | str, bytes | str]],
) -> list[tuple[bytes | str, bytes | str]]:
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


def _as_byte_buffer(body: Body) -> Body:
    """``body`` itself when ``len()`` counts its bytes, else a byte view of
    it (a typed or multi-dimensional memoryview, e.g. over a numpy array).
    Never a copy."""
    if isinstance(body, (bytes, bytearray)):
        return body
    if isinstance(body, memoryview):
        if body.format == "B" and body.ndim == 1:
            return body
        if not body.c_contiguous:
            raise ValueError("a body memoryview must be C-contiguous")
        return body.cast("B")
    raise TypeError("body must be bytes, bytearray or memoryview")
