"""A server's answers: their heads, as pure functions (what an answer's
caller may set, what the connection adds, the checks that keep us from
sending what our own peer would refuse), and `ServerAnswers`, the answering
half of `ServerConnection` (final answers, streamed answers, interim 100s),
which moves the server's phase as each answer goes out.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from http import HTTPStatus

import h11

from ._body import Body, Output, as_byte_buffer
from ._codec import body_bound
from ._errors import MeshnetError, error_body
from ._headers import WireHeaders
from ._state import SERVER_ERROR_ANSWERABLE, ServerPhase, ServerTrigger, server_next

__all__ = [
    "Pairs",
    "ServerAnswers",
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


# h11's events are immutable: every answer's end can be the same one.
_END_OF_MESSAGE = h11.EndOfMessage()


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
    if headers.encoding == "identity":
        promised = headers.nbytes  # computed once: every answer comes here
        if nbytes != promised:
            raise ValueError(f"identity body of {nbytes} bytes, headers promise {promised}")
    elif nbytes > (bound := body_bound(headers)):
        raise ValueError(f"body of {nbytes} bytes over its bound {bound}")
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


_P, _T = ServerPhase, ServerTrigger


class ServerAnswers:
    """The answering half of `ServerConnection`: bytes out for each answer.

    Shares the connection's h11 and phase; the reading half sets
    ``_answering_head`` from each request.
    """

    _h11: h11.Connection
    _phase: ServerPhase
    _needs_drain: bool
    _answering_head: bool

    def _move(self, trigger: ServerTrigger) -> None:
        # Every phase change of both halves: the server's table in `_state`.
        self._phase = server_next(self._phase, trigger)

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
        self._send_pieces(_END_OF_MESSAGE)
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
        out = self._send_pieces(_END_OF_MESSAGE)
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
