"""`ServerConnection`: the server side of one HTTP/1.1 connection, sans IO.

It wraps ``h11.Connection(h11.SERVER)`` and adds what wire 2 needs on top of
HTTP, each in its own module: the head checks (wire-2 §7 credentials,
routing to 404/405, the framing rules h11 leaves to us: `_head_checks`), the
wire headers (`parse_wire_headers`), a body held to its bound while it
streams into one preallocated buffer (`_body`, `_body_bypass`), the decode,
and the answers' heads (`_answers`).

The connection runs a small state machine of its own over h11's (the
server's table in `_state`): one request/response cycle after another on
the same connection, restarted automatically once a response has gone out
and both sides are done. Errors are sticky: after a `ProtocolErrorReceived`
the only thing left to do is ``send_error()`` and close.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import h11
import numpy as np
import zstandard

from . import _head_checks as checks
from ._answers import (
    Pairs,
    activation_pairs,
    caller_headers,
    check_stream_status,
    error_answer,
    h11_response,
    response_pairs,
)
from ._body import Body, BodyReader, Output, as_byte_buffer, body_buffer
from ._body_bypass import take_body_bytes
from ._codec import decode_tensor
from ._errors import MeshnetError
from ._events import (
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
from ._reading import H11Reader
from ._state import SERVER_ERROR_ANSWERABLE, ServerPhase, ServerTrigger, server_next

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

_P, _T = ServerPhase, ServerTrigger
_Handled = ActivationHead | ActivationReceived | EndpointRequest | ConnectionClosed


class ServerConnection(H11Reader[_Handled]):
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
        super().__init__(h11.SERVER, limits)
        self._limits = limits
        self._token = token.encode() if token is not None else None
        self._activation_path = activation_path
        self._require_sequencing = require_sequencing
        self._routes = {pattern: frozenset(methods) for pattern, methods in routes.items()}
        self._max_endpoint_body = max_endpoint_body
        self._decompressor = decompressor
        self._phase = _P.IDLE
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
        self._body: BodyReader | None = None
        self._endpoint: tuple[str, str, str, str, tuple[tuple[bytes, bytes], ...]] | None = None

    def _move(self, trigger: ServerTrigger) -> None:
        self._phase = server_next(self._phase, trigger)

    @property
    def should_close(self) -> bool:
        """True once the transport must be closed: after an error, after an
        answer with ``Connection: close``, or when the peer has closed."""
        return self._phase in (_P.ERROR, _P.CLOSED) or self._h11.our_state in (
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
        return self._phase in (_P.ACTIVATION_BODY, _P.ENDPOINT_BODY)

    @property
    def needs_drain(self) -> bool:
        """True when an answer went out before the request was fully read.

        Closing a socket with unread input makes the kernel send a reset,
        which can destroy the answer in flight; the driver should read and
        discard what the client still sends (briefly: e.g. up to 64 KiB or
        1 s), then close.
        """
        return self._needs_drain

    @property
    def can_send_error(self) -> bool:
        """True while `send_error` may still write an answer: not once a
        streamed answer's head went out, nor after the connection closed.
        A driver that cannot answer any more closes the transport instead."""
        return self._phase in SERVER_ERROR_ANSWERABLE

    # ------------------------------------------------------------- input

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer bytes from the transport; ``b""`` means end of stream.

        Bytes of a tensor body go straight into its buffer when h11 has
        nothing unread (`_body_bypass`); the rest, and everything else, to h11.
        """
        body = self._body
        if data and self._h11_drained and body is not None and self._phase is _P.ACTIVATION_BODY:
            data = take_body_bytes(self._h11, data, body.add)
            if not data:
                return
        self._feed(data)

    def next_event(self) -> _Handled | ProtocolErrorReceived | NeedData | Paused:
        """The next event, `NEED_DATA` (feed more bytes) or `PAUSED` (the
        request is complete: answer it).

        Never raises for anything the peer sends: bad input comes back as
        `ProtocolErrorReceived`, once; after it (and after any closing
        answer) every call returns `ConnectionClosed`.
        """
        if self._phase in (_P.ERROR, _P.CLOSED):
            return ConnectionClosed()
        if self._phase is _P.RESPONDING:
            return PAUSED
        try:
            if self._phase is _P.HEAD_DELIVERED:
                self._start_activation_body()
            return self._pump()
        except h11.RemoteProtocolError as exc:
            return self._fail(checks.from_h11(exc, self._limits))
        except MeshnetError as exc:
            return self._fail(exc)

    def _fail(self, error: MeshnetError) -> ProtocolErrorReceived:
        self._move(_T.PROTOCOL_ERROR)
        self._reset_cycle()
        return ProtocolErrorReceived(error=error)

    def _handle(self, event: object) -> _Handled | None:
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
        self._move(_T.PEER_CLOSED)
        return ConnectionClosed()

    def _on_head(self, request: h11.Request) -> ActivationHead | None:
        self._answering_head = request.method == b"HEAD"
        checks.check_head(request, self._limits)
        # h11 has validated both as visible ASCII.
        method = request.method.decode("ascii")
        path, _, query = request.target.decode("ascii").partition("?")
        headers = tuple(request.headers)

        # wire-2 §2 order: credentials, path/method, framing, wire headers.
        if checks.needs_credentials(self._token, path, query):
            assert self._token is not None
            checks.check_credentials(headers, self._token)
        route = checks.check_route(method, path, self._activation_path, self._routes)
        content_length = checks.check_framing(method, headers)

        if route is not None:
            if content_length is not None and content_length > self._max_endpoint_body:
                raise checks.endpoint_body_too_large(self._max_endpoint_body)
            self._endpoint = (method, route, path, query, headers)
            initial = content_length if content_length is not None else 0
            self._body = BodyReader(bytearray(initial), self._max_endpoint_body)
            self._move(_T.ENDPOINT_HEAD)
            return None

        wire = parse_wire_headers(
            headers, limits=self._limits, require_sequencing=self._require_sequencing
        )
        checks.check_activation_length(wire, content_length)
        self._wire = wire
        self._query = query
        self._content_length = content_length
        self._move(_T.ACTIVATION_HEAD)
        return ActivationHead(
            headers=wire,
            expects_continue=self._h11.they_are_waiting_for_100_continue,
            query=query,
        )

    def _start_activation_body(self) -> None:
        wire = self._wire
        assert wire is not None
        self._move(_T.READ_BODY)
        size = checks.activation_body_size(wire, self._content_length)
        self._body = BodyReader(body_buffer(size), size)

    def _on_end(self) -> ActivationReceived | EndpointRequest:
        body = self._body
        assert body is not None
        if self._phase is _P.ENDPOINT_BODY:
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
        self._move(_T.REQUEST_COMPLETE)
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
        return self._send_continue()

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
        return self._send_continue()

    def send_activation(self, headers: WireHeaders, body: Body) -> Output:
        """``200`` with ``headers.to_pairs()`` and ``Content-Length``.

        The returned list holds the head's bytes and then ``body`` itself —
        the very object passed (cast to bytes when it is a memoryview of
        another format), never a copy: write the pieces in order.
        """
        pairs, data = activation_pairs(headers, body)
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
        pairs, data = response_pairs(status, headers, body)
        return self._respond(status, pairs, data)

    def send_error(self, error: MeshnetError) -> Output:
        """The wire-2 §4 JSON answer for ``error`` (only while `can_send_error`).

        Adds ``Retry-After`` when ``error.retry_after`` is set and
        ``WWW-Authenticate: Bearer`` on 401. Answering before the request
        was fully read (an early reject, a timeout, a protocol error) adds
        ``Connection: close``; see `needs_drain`.
        """
        pairs, body = error_answer(error)
        return self._respond(error.status, pairs, body)

    def start_next_cycle(self) -> None:
        """Kept for drivers written against h11's habit; the connection
        restarts by itself once an answer to a complete request has gone out
        and the connection stays open, so this only checks that it did."""
        if self._phase is not _P.IDLE:
            raise RuntimeError(f"no finished exchange to restart (phase {self._phase.value!r})")

    def _respond(self, status: int, pairs: Pairs, data: Body) -> Output:
        if self._phase is _P.CLOSED:
            raise RuntimeError("the connection is closed; nothing more can be sent")
        early = self._phase is not _P.RESPONDING
        if early:
            pairs.append((b"Connection", b"close"))
        # One bytes object for the head (one write, not one per header line),
        # then the body object itself, untouched.
        head = b"".join(self._send_pieces(h11_response(status, pairs)))
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
            self._move(_T.ANSWERED_CLOSE)
        elif self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
            self._h11.start_next_cycle()
            self._move(_T.ANSWERED_KEEP_ALIVE)
        else:
            # The client said Connection: close, or spoke HTTP/1.0.
            self._move(_T.ANSWERED_CLOSE)

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
        if self._phase is not _P.RESPONDING:
            raise RuntimeError(f"no complete request to answer (phase {self._phase.value!r})")
        check_stream_status(status)
        response = h11_response(status, caller_headers(headers))
        head = b"".join(self._send_pieces(response))
        self._move(_T.STREAM_STARTED)
        return head

    def send_stream_data(self, data: Body) -> Output:
        """One piece of a streamed body (nothing for an empty piece or a HEAD)."""
        if self._phase is not _P.STREAMING:
            raise RuntimeError(f"no streamed answer in progress (phase {self._phase.value!r})")
        data = as_byte_buffer(data)
        if not len(data) or self._answering_head:
            return []
        return self._send_pieces(h11.Data(data=data))  # type: ignore[arg-type]  # as in _respond

    def send_stream_end(self) -> Output:
        """End a streamed body: the closing chunk, then keep-alive or close."""
        if self._phase is not _P.STREAMING:
            raise RuntimeError(f"no streamed answer in progress (phase {self._phase.value!r})")
        out = self._send_pieces(h11.EndOfMessage())
        self._finish(early=False)
        return out

    def _send_pieces(
        self, event: h11.InformationalResponse | h11.Response | h11.Data | h11.EndOfMessage
    ) -> Output:
        try:
            pieces = self._h11.send_with_data_passthrough(event)
        except h11.LocalProtocolError as exc:
            # h11's own state check, behind ours (e.g. an error answer after
            # a streamed head): a driver-facing error, not h11's internals.
            raise RuntimeError(f"cannot send this now: {exc}") from exc
        assert pieces is not None
        return list(pieces)

    def _send_continue(self) -> bytes:
        continue_ = h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
        return b"".join(self._send_pieces(continue_))  # a head only: small
