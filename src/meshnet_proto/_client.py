"""`ClientConnection`: the client side of one HTTP/1.1 connection, sans IO.

What a node runs toward its ``--next`` and the gateway toward its entry
node. It wraps ``h11.Connection(h11.CLIENT)``; sends are pass-through (the
tensor body is handed back untouched, never joined), and every response body
is held to a bound before a byte of it is stored — a downstream, like any
peer, must not be able to make us allocate at will.

A response the downstream should never have sent (unparseable HTTP, wire
headers that do not parse, a body over its bound or that does not decode) is
*raised* as `DownstreamError` from ``next_event()`` — 502
``downstream_bad_response`` — rather than returned as an event: the driver
already has an ``except`` around the downstream call for unreachable hosts
and timeouts, and all three end the same way (answer 502/504 upstream, drop
the connection). A connection that ends before its response is complete is
502 ``downstream_unreachable`` ("connection dropped"). Errors are sticky.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import h11
import numpy as np
import zstandard

from ._body import Body, BodyReader, Output, as_byte_buffer, body_buffer
from ._body_bypass import take_body_bytes
from ._codec import body_bound, decode_tensor
from ._errors import DownstreamError, ErrorCode, MeshnetError
from ._events import (
    NEED_DATA,
    ActivationResponse,
    ConnectionClosed,
    ErrorResponse,
    NeedData,
    Response,
)
from ._headers import WireHeaders, parse_wire_headers
from ._integers import parse_canonical_uint
from ._limits import Limits, MiB
from ._reading import H11Reader
from ._state import ClientPhase, ClientTrigger, client_next

__all__ = ["ClientConnection"]

# Error bodies are a few hundred bytes, /info a few KiB; /metrics of a busy
# node can reach tens of KiB. 1 MiB is generous for all of them and still
# nothing a misbehaving downstream can hurt us with.
DEFAULT_MAX_RESPONSE_BODY = 1 * MiB
# How much of a non-JSON error body is quoted in the synthesised message.
_SNIPPET = 200

_SEQUENCING_HEADERS = (b"x-meshnet-session", b"x-meshnet-chunk-index", b"x-meshnet-chunk-total")


_P, _T = ClientPhase, ClientTrigger


class _Kind(enum.Enum):
    ACTIVATION = "activation"  # a 200 to send_activation
    ERROR = "error"  # any status >= 400
    OTHER = "other"  # a success to send_request


@dataclass(slots=True)
class _Pending:
    kind: _Kind
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: BodyReader
    wire: WireHeaders | None = None


_Answer = ActivationResponse | ErrorResponse | Response


class ClientConnection(H11Reader[_Answer]):
    """The client side of one connection toward a downstream.

    ``host`` goes in the ``Host`` header; ``token`` is presented as
    ``Authorization: Bearer`` (wire-2 §7: a node presents its own token);
    ``hop`` (the downstream's URL as configured) is put in every
    `DownstreamError` raised here; ``decode=False`` leaves
    `ActivationResponse.tensor` as ``None`` (a relay that passes the body
    through never needs the tensor); ``max_response_body`` caps bodies other
    than a 200 activation (those are held to their headers' bound).
    """

    def __init__(
        self,
        *,
        limits: Limits = Limits(),  # noqa: B008 - frozen, shared safely
        host: str = "downstream",
        token: str | None = None,
        hop: str | None = None,
        decode: bool = True,
        max_response_body: int = DEFAULT_MAX_RESPONSE_BODY,
        decompressor: zstandard.ZstdDecompressor | None = None,
    ) -> None:
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError("token must be a non-empty str or None")
        if max_response_body < 0:
            raise ValueError("max_response_body must be >= 0")
        super().__init__(h11.CLIENT, limits)
        self._limits = limits
        self._host = host.encode("ascii")
        self._token = token.encode("ascii") if token is not None else None
        self._hop = hop
        self._decode = decode
        self._max_response_body = max_response_body
        self._decompressor = decompressor
        self._phase = _P.IDLE
        self._activation = False
        self._pending: _Pending | None = None
        self._error: DownstreamError | None = None
        self._eof = False

    # ------------------------------------------------------------- state

    @property
    def reusable(self) -> bool:
        """True when a new request may be sent on this connection: nothing
        outstanding, no error, no ``Connection: close``, no end of stream."""
        return (
            self._phase is _P.IDLE
            and not self._eof
            and self._h11.our_state is h11.IDLE
            and self._h11.their_state is h11.IDLE
        )

    def start_next_cycle(self) -> None:
        """Kept for h11-style drivers: the connection restarts by itself
        after a complete keep-alive exchange; this only checks it did."""
        if not self.reusable:
            raise RuntimeError(f"connection not reusable (phase {self._phase.value!r})")

    def _bad(self, message: str, *, header: str | None = None) -> DownstreamError:
        return DownstreamError(
            f"downstream answered garbage: {message}",
            code=ErrorCode.DOWNSTREAM_BAD_RESPONSE,
            header=header,
            hop=self._hop,
        )

    def _move(self, trigger: ClientTrigger) -> None:
        self._phase = client_next(self._phase, trigger)

    def _fail(self, error: DownstreamError) -> DownstreamError:
        self._move(_T.BAD_RESPONSE)
        self._pending = None
        self._error = error
        return error

    # ------------------------------------------------------------- output

    def send_activation(self, headers: WireHeaders, body: Body, path: str = "/forward") -> Output:
        """A ``POST`` of one wire-2 message. Returns the head's bytes and then
        ``body`` itself (pass-through: write the pieces in order)."""
        if not isinstance(headers, WireHeaders):
            raise TypeError("headers must be a WireHeaders")
        data = as_byte_buffer(body)
        pairs: list[tuple[bytes, bytes]] = [
            (b"Host", self._host),
            *headers.to_pairs(),
            (b"Content-Length", str(len(data)).encode("ascii")),
        ]
        if self._token is not None:
            pairs.append((b"Authorization", b"Bearer " + self._token))
        return self._send(b"POST", path.encode("ascii"), pairs, data, activation=True)

    def send_request(
        self,
        method: str,
        target: str,
        headers: Iterable[tuple[bytes | str, bytes | str]] = (),
        body: Body = b"",
        *,
        expects_activation: bool = False,
    ) -> Output:
        """Any other request (``GET /health``, ``DELETE /sessions/{id}``, …).

        ``Host``, ``Content-Length`` (when there is a body, or for POST/PUT)
        and ``Authorization`` (when a token is set) are added unless given.
        ``expects_activation``: its 200 is a wire-2 message (``GET /kv/{id}``,
        wire-2 §3.11), read and bounded as an activation's answer is.
        """
        data = as_byte_buffer(body)
        pairs: list[tuple[bytes, bytes]] = [
            (_to_bytes(name), _to_bytes(value)) for name, value in headers
        ]
        given = {name.lower() for name, _ in pairs}
        if b"host" not in given:
            pairs.insert(0, (b"Host", self._host))
        if b"content-length" not in given and (len(data) or method in ("POST", "PUT", "PATCH")):
            pairs.append((b"Content-Length", str(len(data)).encode("ascii")))
        if self._token is not None and b"authorization" not in given:
            pairs.append((b"Authorization", b"Bearer " + self._token))
        return self._send(
            method.encode("ascii"),
            target.encode("ascii"),
            pairs,
            data,
            activation=expects_activation,
        )

    def _send(
        self,
        method: bytes,
        target: bytes,
        pairs: list[tuple[bytes, bytes]],
        data: Body,
        *,
        activation: bool,
    ) -> Output:
        if not self.reusable:
            raise RuntimeError(
                f"cannot send a request now (phase {self._phase.value!r}); "
                "use a new connection when this one is not reusable"
            )
        try:
            head = b"".join(
                self._h11.send_with_data_passthrough(
                    h11.Request(method=method, target=target, headers=pairs)
                )
                or ()
            )
            out: Output = [head]
            if len(data):
                # Passthrough hands the object back untouched, so any
                # bytes-like works; h11's annotation says bytes.
                data_event = h11.Data(data=data)  # type: ignore[arg-type]
                out += self._h11.send_with_data_passthrough(data_event) or ()
            self._h11.send(h11.EndOfMessage())
        except h11.LocalProtocolError as exc:
            self._move(_T.SEND_REFUSED)
            raise ValueError(f"cannot send this request: {exc}") from exc
        self._activation = activation
        self._move(_T.REQUEST_SENT)
        return out

    # ------------------------------------------------------------- input

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer bytes from the transport; ``b""`` means end of stream.

        Bytes of a Content-Length response body go straight into its buffer
        when h11 has nothing unread (`_body_bypass`); the rest to h11.
        """
        if not data:
            self._eof = True
        elif self._h11_drained and self._pending is not None:
            data = take_body_bytes(self._h11, data, self._pending.body.add)
            if not data:
                return
        self._feed(data)

    def next_event(self) -> _Answer | ConnectionClosed | NeedData:
        """The response to the outstanding request, `NEED_DATA`, or
        `ConnectionClosed` (idle connection ended: drop it from the pool).

        Raises `DownstreamError` (502) for a response that is garbage or cut
        short; once raised, every later call raises it again.
        """
        if self._error is not None:
            raise self._error
        if self._phase is _P.CLOSED:
            return ConnectionClosed()
        if self._phase is _P.IDLE:
            return self._next_idle()
        try:
            return self._pump()
        except h11.RemoteProtocolError as exc:
            reason = str(exc).split(":", 1)[0]
            if self._eof:
                raise self._fail(
                    DownstreamError(
                        f"downstream closed the connection before its response was complete "
                        f"({reason})",
                        code=ErrorCode.DOWNSTREAM_UNREACHABLE,
                        hop=self._hop,
                    )
                ) from None
            raise self._fail(self._bad(f"unreadable HTTP ({reason})")) from None
        except DownstreamError as exc:
            raise self._fail(exc) from None
        except MeshnetError as exc:
            # The downstream's headers or body broke a wire rule: its fault,
            # so 502, naming the header it got wrong.
            raise self._fail(self._bad(exc.message, header=exc.header)) from None

    def _next_idle(self) -> ConnectionClosed | NeedData:
        # Between exchanges the only news a server can send is that it is
        # going away: an end of stream, or a 408/503 and a close.
        try:
            event = self._h11.next_event()
        except h11.RemoteProtocolError:
            event = None
        if event is h11.NEED_DATA:
            return NEED_DATA
        self._move(_T.PEER_CLOSED)
        return ConnectionClosed()

    def _handle(self, event: object) -> _Answer | None:
        if isinstance(event, h11.InformationalResponse):
            return None  # 100 Continue and friends: the real answer follows
        if isinstance(event, h11.Response):
            self._pending = self._on_head(event)
            self._move(_T.RESPONSE_HEAD)
            return None
        if isinstance(event, h11.Data):
            assert self._pending is not None
            self._pending.body.add(event.data)
            return None
        # A client-side h11 yields nothing else mid-response: a close is
        # raised as RemoteProtocolError.
        assert isinstance(event, h11.EndOfMessage), event
        return self._on_end()

    def _on_head(self, response: h11.Response) -> _Pending:
        status = response.status_code
        headers = tuple(response.headers)
        lengths = [int(value) for name, value in headers if name == b"content-length"]
        length = lengths[0] if lengths else None
        if status > 599:  # h11 takes any three digits; HTTP statuses end at 599
            raise self._bad(f"status {status} is not an HTTP status")
        if status >= 400:
            kind, wire, limit = _Kind.ERROR, None, self._max_response_body
        elif not self._activation:
            kind, wire, limit = _Kind.OTHER, None, self._max_response_body
        elif status != 200:
            raise self._bad(f"status {status} to an activation (expected 200 or an error)")
        else:
            present = {name for name, _ in headers}
            # A response mirrors its request's sequencing headers when it has
            # them; hold it to the strict rules then, to the gateway's else.
            strict = all(name in present for name in _SEQUENCING_HEADERS)
            wire = parse_wire_headers(
                headers, limits=self._limits, require_sequencing=strict, answer=True
            )
            kind, limit = _Kind.ACTIVATION, body_bound(wire)
            if length is not None and wire.encoding == "identity" and length != wire.nbytes:
                raise self._bad(
                    f"Content-Length {length} for a {wire.nbytes}-byte identity tensor",
                    header="content-length",
                )
        if length is not None and length > limit:
            raise self._bad(
                f"Content-Length {length} over the bound of {limit} bytes",
                header="content-length",
            )
        # Content-Length known: exactly that. Chunked or until-close: start
        # at the bound for a tensor (its size is known), small otherwise.
        if length is not None:
            size = length
        elif kind is _Kind.ACTIVATION:
            size = limit
        else:
            size = 0
        # A bytearray (size 0: small bodies) grows as it fills.
        body = BodyReader(body_buffer(size), limit, what="response")
        return _Pending(kind, status, headers, body, wire)

    def _on_end(self) -> _Answer:
        pending = self._pending
        assert pending is not None
        self._pending = None
        body = pending.body.view().toreadonly()
        filled = pending.body.filled
        result: _Answer
        if pending.kind is _Kind.ACTIVATION:
            wire = pending.wire
            assert wire is not None
            tensor: np.ndarray | None = None
            if self._decode:
                tensor = decode_tensor(
                    wire, body, limits=self._limits, decompressor=self._decompressor
                )
            elif wire.encoding == "identity" and filled != wire.nbytes:
                raise self._bad(f"identity body of {filled} bytes for {wire.nbytes}")
            result = ActivationResponse(status=200, headers=wire, body=body, tensor=tensor)
        elif pending.kind is _Kind.ERROR:
            raw = bytes(body)
            error = _error_object(pending.status, raw)
            result = ErrorResponse(
                status=error["status"],
                error=error,
                raw=raw,
                retry_after=_retry_after(pending.headers),
            )
        else:
            result = Response(status=pending.status, headers=pending.headers, body=bytes(body))
        if self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
            self._h11.start_next_cycle()
            self._move(_T.RESPONSE_DONE_KEEP_ALIVE)
        else:
            # Connection: close, HTTP/1.0, or a server that answered before
            # taking our whole request: this connection is spent.
            self._move(_T.RESPONSE_DONE_CLOSE)
        return result


def _error_object(status: int, raw: bytes) -> dict[str, Any]:
    """The inner wire-2 §4 object of ``raw``, or one made up for a body that
    is not one (the HTTP status is authoritative either way)."""
    try:
        document = json.loads(raw)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError alike
        document = None
    inner = document.get("error") if isinstance(document, dict) else None
    if (
        isinstance(inner, dict)
        and isinstance(inner.get("code"), str)
        and isinstance(inner.get("message"), str)
        and isinstance(inner.get("header"), (str, type(None)))
        and isinstance(inner.get("hop"), (str, type(None)))
    ):
        return {
            "status": status,
            "code": inner["code"],
            "message": inner["message"],
            "header": inner.get("header"),
            "hop": inner.get("hop"),
        }
    snippet = raw[:_SNIPPET].decode("utf-8", "replace")
    return {
        # A 500 is a node's own bug (wire-2 §4); one without a wire-2 error body is a
        # downstream answering garbage, which is 502, so a relaying node never
        # answers 500 for what is not its fault. Other statuses carry meaning
        # for the sender (4xx, 503 + Retry-After) and are relayed as they are.
        "status": 502 if status == 500 else status,
        "code": "downstream_bad_response",
        "message": f"downstream answered {status} without a wire-2 §4 error body: {snippet!r}",
        "header": None,
        "hop": None,
    }


def _retry_after(headers: tuple[tuple[bytes, bytes], ...]) -> int | None:
    for name, value in headers:
        if name == b"retry-after":
            try:
                return parse_canonical_uint(value, header="retry-after")
            except MeshnetError:
                return None  # an HTTP-date or junk: no hint rather than a wrong one
    return None


def _to_bytes(value: bytes | str) -> bytes:
    return value.encode("ascii") if isinstance(value, str) else value
