"""`ServerConnection`: the server side of one HTTP/1.1 connection, sans IO.

It wraps ``h11.Connection(h11.SERVER)`` and adds what wire 2 needs on top of
HTTP, each in its own module: the head checks (wire-2 §7 credentials,
routing to 404/405, the framing rules h11 leaves to us: `_head_checks`), the
wire headers (`parse_wire_headers`), a body held to its bound while it
streams into one preallocated buffer (`_body`, `_body_bypass`), the decode,
and the answers (`_answers`: their heads, and `ServerAnswers`, the half of
this class that sends them). What is left here is the reading half: bytes
in, events out.

The connection runs a small state machine of its own over h11's (the
server's table in `_state`): one request/response cycle after another on
the same connection, restarted automatically once a response has gone out
and both sides are done. Errors are sticky: after a `ProtocolErrorReceived`
the only thing left to do is ``send_error()`` and close.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import h11
import numpy as np
import zstandard

from ._answers import ServerAnswers
from ._body import BodyReader
from ._body_bypass import take_body_bytes
from ._codec import decode_tensor
from ._credentials import CHAIN, Credentials, HeadCheck, Principal
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
    activation_head,
    activation_received,
    is_replay,
)
from ._head_checks import (
    activation_body_size,
    check_activation_length,
    check_framing,
    check_head,
    check_route,
    endpoint_body_too_large,
    from_h11,
    is_preflight,
)
from ._headers import parse_wire_headers
from ._kv import check_kv_message, is_kv_import
from ._limits import KiB, Limits
from ._reading import H11Reader
from ._state import ServerPhase, ServerTrigger

__all__ = ["DEFAULT_MAX_ENDPOINT_BODY", "DEFAULT_ROUTES", "ServerConnection"]

# wire-2 §6. A key ending in "/*" matches exactly one non-empty path segment in
# its place, which is all `DELETE /sessions/{id}`, `GET /kv/{id}` and
# `GET /drawn/{id}` (§3.14) need; one ending in "/**" (a server's own routes
# only) any non-empty rest of the path. The first key that matches is the route.
DEFAULT_ROUTES: Mapping[str, Collection[str]] = {
    "/health": ("GET",),
    "/info": ("GET",),
    "/metrics": ("GET",),
    "/sessions/*": ("DELETE",),
    "/kv/*": ("GET",),
    "/drawn/*": ("GET",),
}

# The control endpoints take at most a few hundred bytes of JSON; 64 KiB
# leaves room for growth while keeping an unauthenticated (/health) or
# hostile body from costing anything.
DEFAULT_MAX_ENDPOINT_BODY = 64 * KiB

_P, _T = ServerPhase, ServerTrigger
_Handled = ActivationHead | ActivationReceived | EndpointRequest | ConnectionClosed


class ServerConnection(H11Reader[_Handled], ServerAnswers):
    """The server side of one connection: bytes in, events out; answers in,
    bytes out. See ``docs/embedding.md`` for the driver loop.

    ``token``: when set, every path but a plain ``/health`` (``?deep=1``
    included) needs ``Authorization: Bearer <token>`` (wire-2 §7); or
    ``credentials``: the chain's tokens and clients' API keys
    (`Credentials`), whose `Principal` is ``principal`` while a request is
    served. ``head_check(method, path, query, headers)`` runs on every
    head before the credentials (a gateway's Host and Origin checks); the
    ``MeshnetError`` it raises is the request's answer. ``activation_path`` takes
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
        credentials: Credentials | None = None,
        head_check: HeadCheck | None = None,
        activation_path: str = "/forward",
        require_sequencing: bool = True,
        routes: Mapping[str, Collection[str]] = DEFAULT_ROUTES,
        max_endpoint_body: int = DEFAULT_MAX_ENDPOINT_BODY,
        decompressor: zstandard.ZstdDecompressor | None = None,
    ) -> None:
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError("token must be a non-empty str or None")
        if token is not None and credentials is not None:
            raise ValueError("give token or credentials, not both")
        if not activation_path.startswith("/"):
            raise ValueError("activation_path must start with '/'")
        if max_endpoint_body < 0:
            raise ValueError("max_endpoint_body must be >= 0")
        super().__init__(h11.SERVER, limits)
        self._limits = limits
        self._credentials = credentials or Credentials(() if token is None else (token,))
        self._head_check = head_check
        self._principal = CHAIN
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
        self._head: ActivationHead | None = None  # the activation's, until its body ends
        self._content_length: int | None = None
        self._body: BodyReader | None = None
        self._endpoint: tuple[str, str, str, str, tuple[tuple[bytes, bytes], ...]] | None = None

    @property
    def principal(self) -> Principal:
        """Whom the request being served comes from (wire-2 §7)."""
        return self._principal

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
            return self._fail(from_h11(exc, self._limits))
        except MeshnetError as exc:
            return self._fail(exc)

    def _fail(self, error: MeshnetError) -> ProtocolErrorReceived:
        self._move(_T.PROTOCOL_ERROR)
        self._reset_cycle()
        return ProtocolErrorReceived(error=error)

    def _handle(self, event: object) -> _Handled | None:
        # By exact type: h11's events derive from an ABC, so isinstance()
        # goes through ABCMeta (~0.4 us each, four a decode step); h11 makes
        # these classes themselves, never subclasses.
        if type(event) is h11.Request:
            return self._on_head(event)
        if type(event) is h11.Data:
            assert self._body is not None
            self._body.take(event.data)  # h11's own slice: kept if it is the whole body
            return None
        if type(event) is h11.EndOfMessage:
            return self._on_end()
        # h11 yields nothing else from a client but ConnectionClosed (PAUSED
        # cannot happen: we never ask h11 while RESPONDING).
        assert isinstance(event, h11.ConnectionClosed), event
        self._move(_T.PEER_CLOSED)
        return ConnectionClosed()

    def _on_head(self, request: h11.Request) -> ActivationHead | None:
        self._answering_head = request.method == b"HEAD"
        headers = tuple(request.headers)
        check_head(request, headers, self._limits)
        # h11 has validated both as visible ASCII.
        method = request.method.decode("ascii")
        path, _, query = request.target.decode("ascii").partition("?")

        # wire-2 §2 order: credentials, path/method, framing, wire headers.
        if self._head_check is not None:
            self._head_check(method, path, query, headers)
        if is_preflight(method, path, self._routes):
            self._principal = CHAIN  # no credential to name; its answer holds no data
        else:
            self._principal = self._credentials.identify(headers, path, query)
        route = check_route(method, path, self._activation_path, self._routes)
        content_length = check_framing(method, headers)

        if route is not None:
            if content_length is not None and content_length > self._max_endpoint_body:
                raise endpoint_body_too_large(self._max_endpoint_body)
            self._endpoint = (method, route, path, query, headers)
            initial = content_length if content_length is not None else 0
            self._body = BodyReader(bytearray(initial), self._max_endpoint_body)
            self._move(_T.ENDPOINT_HEAD)
            return None

        wire = parse_wire_headers(
            headers, limits=self._limits, require_sequencing=self._require_sequencing
        )
        check_activation_length(wire, content_length)
        kv_import = is_kv_import(query)
        check_kv_message(wire, kv_import)  # wire-2 §3.11: KV headers on KV only
        self._content_length = content_length
        self._move(_T.ACTIVATION_HEAD)
        expects_continue = self._h11.they_are_waiting_for_100_continue
        self._head = activation_head(wire, expects_continue, query, is_replay(query), kv_import)
        return self._head

    def _start_activation_body(self) -> None:
        head = self._head
        assert head is not None
        self._move(_T.READ_BODY)
        size = activation_body_size(head.headers, self._content_length)
        self._body = BodyReader(None, size)  # made at the first piece (BodyReader)

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
            head = self._head
            assert head is not None
            tensor: np.ndarray = decode_tensor(
                head.headers, body.view(), limits=self._limits, decompressor=self._decompressor
            )
            event = activation_received(head, tensor, body.filled)
        self._move(_T.REQUEST_COMPLETE)
        self._reset_cycle()
        return event
