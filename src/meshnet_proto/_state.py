"""The phases of both connection roles and the table of their transitions.

Like h11's ``_state``: a phase changes only by looking up ``(phase,
trigger)`` in its role's table, so what a connection may do next is read
here, in one place, not pieced together from assignments spread over the
connection code. A pair that is absent is a bug in meshnet_proto or a driver
calling out of turn: `server_next` and `client_next` raise ``RuntimeError``
naming both.

The server runs one request/response cycle after another on the same
connection; the client sends one request at a time and reads its response.
Both restart themselves after a complete keep-alive exchange, and both keep
an error for good.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

__all__ = [
    "CLIENT_TRANSITIONS",
    "SERVER_ERROR_ANSWERABLE",
    "SERVER_TRANSITIONS",
    "ClientPhase",
    "ClientTrigger",
    "ServerPhase",
    "ServerTrigger",
    "client_next",
    "server_next",
]


class _Fast(enum.Enum):
    # Enum hashes a member by its name, in Python, on every table lookup
    # (twice per transition: the key is a pair); members are singletons, so
    # the identity hash is the same mapping, done in C.
    __hash__ = object.__hash__


class ServerPhase(_Fast):
    IDLE = "idle"  # waiting for (the rest of) a request head
    HEAD_DELIVERED = "head delivered"  # ActivationHead returned, body unread
    ACTIVATION_BODY = "activation body"  # reading the tensor body
    ENDPOINT_BODY = "endpoint body"  # reading a small control body
    RESPONDING = "responding"  # request complete: the driver's turn to answer
    STREAMING = "streaming"  # a streamed answer's head went out, its body follows
    ERROR = "error"  # ProtocolErrorReceived returned: answer, then close
    CLOSED = "closed"  # nothing more will be read; close the transport


class ServerTrigger(_Fast):
    ACTIVATION_HEAD = "activation head"
    ENDPOINT_HEAD = "endpoint head"
    READ_BODY = "read body"
    REQUEST_COMPLETE = "request complete"
    PROTOCOL_ERROR = "protocol error"
    PEER_CLOSED = "peer closed"
    STREAM_STARTED = "stream started"
    ANSWERED_KEEP_ALIVE = "answered, keep-alive"
    ANSWERED_CLOSE = "answered, close"


_SP, _ST = ServerPhase, ServerTrigger

# Where an error answer (a whole response, Connection: close unless the
# request was complete) can still be written: not once a streamed answer's
# head went out (the status is sent), nor after the connection closed.
SERVER_ERROR_ANSWERABLE: frozenset[ServerPhase] = frozenset(
    {
        _SP.IDLE,  # a head timeout with part of a head read: 408
        _SP.HEAD_DELIVERED,  # the application rejected the head
        _SP.ACTIVATION_BODY,  # a body timeout
        _SP.ENDPOINT_BODY,
        _SP.RESPONDING,  # the application raised
        _SP.ERROR,  # the answer to a ProtocolErrorReceived
    }
)

SERVER_TRANSITIONS: Mapping[tuple[ServerPhase, ServerTrigger], ServerPhase] = {
    (_SP.IDLE, _ST.ACTIVATION_HEAD): _SP.HEAD_DELIVERED,
    (_SP.IDLE, _ST.ENDPOINT_HEAD): _SP.ENDPOINT_BODY,
    (_SP.HEAD_DELIVERED, _ST.READ_BODY): _SP.ACTIVATION_BODY,
    (_SP.ACTIVATION_BODY, _ST.REQUEST_COMPLETE): _SP.RESPONDING,
    (_SP.ENDPOINT_BODY, _ST.REQUEST_COMPLETE): _SP.RESPONDING,
    (_SP.RESPONDING, _ST.ANSWERED_KEEP_ALIVE): _SP.IDLE,
    (_SP.RESPONDING, _ST.STREAM_STARTED): _SP.STREAMING,
    (_SP.STREAMING, _ST.ANSWERED_KEEP_ALIVE): _SP.IDLE,
    # Bad input is found while reading: a head, or a body. (A head just
    # delivered is read on only after READ_BODY, so HEAD_DELIVERED is not here.)
    (_SP.IDLE, _ST.PROTOCOL_ERROR): _SP.ERROR,
    (_SP.ACTIVATION_BODY, _ST.PROTOCOL_ERROR): _SP.ERROR,
    (_SP.ENDPOINT_BODY, _ST.PROTOCOL_ERROR): _SP.ERROR,
    # h11 reports a close mid-request as an error, so only between requests
    # is it a plain close.
    (_SP.IDLE, _ST.PEER_CLOSED): _SP.CLOSED,
    # Any answer that is not a keep-alive end of a complete exchange closes:
    # an early reject, an error, a timeout, or the client asked to close.
    **{(phase, _ST.ANSWERED_CLOSE): _SP.CLOSED for phase in SERVER_ERROR_ANSWERABLE},
    (_SP.STREAMING, _ST.ANSWERED_CLOSE): _SP.CLOSED,
}


class ClientPhase(_Fast):
    IDLE = "idle"  # no request outstanding
    AWAITING = "awaiting response"  # request sent, response head not complete
    BODY = "response body"  # reading the response body
    ERROR = "error"  # a DownstreamError was raised; it is raised again
    CLOSED = "closed"  # the connection cannot be used again


class ClientTrigger(_Fast):
    REQUEST_SENT = "request sent"
    SEND_REFUSED = "send refused"  # h11 would not frame the request
    RESPONSE_HEAD = "response head"
    RESPONSE_DONE_KEEP_ALIVE = "response done, keep-alive"
    RESPONSE_DONE_CLOSE = "response done, close"
    BAD_RESPONSE = "bad response"  # a DownstreamError is raised
    PEER_CLOSED = "peer closed"  # between exchanges: the server went away


_CP, _CT = ClientPhase, ClientTrigger

CLIENT_TRANSITIONS: Mapping[tuple[ClientPhase, ClientTrigger], ClientPhase] = {
    (_CP.IDLE, _CT.REQUEST_SENT): _CP.AWAITING,
    (_CP.IDLE, _CT.SEND_REFUSED): _CP.CLOSED,
    (_CP.IDLE, _CT.PEER_CLOSED): _CP.CLOSED,
    (_CP.AWAITING, _CT.RESPONSE_HEAD): _CP.BODY,
    (_CP.BODY, _CT.RESPONSE_DONE_KEEP_ALIVE): _CP.IDLE,
    # Connection: close, HTTP/1.0, or a server that answered before taking
    # the whole request: the connection is spent.
    (_CP.BODY, _CT.RESPONSE_DONE_CLOSE): _CP.CLOSED,
    (_CP.AWAITING, _CT.BAD_RESPONSE): _CP.ERROR,
    (_CP.BODY, _CT.BAD_RESPONSE): _CP.ERROR,
}


def server_next(phase: ServerPhase, trigger: ServerTrigger) -> ServerPhase:
    """The server's phase after ``trigger`` in ``phase``."""
    try:
        return SERVER_TRANSITIONS[phase, trigger]
    except KeyError:
        raise RuntimeError(
            f"ServerConnection: cannot handle {trigger.value!r} in phase {phase.value!r}"
        ) from None


def client_next(phase: ClientPhase, trigger: ClientTrigger) -> ClientPhase:
    """The client's phase after ``trigger`` in ``phase``."""
    try:
        return CLIENT_TRANSITIONS[phase, trigger]
    except KeyError:
        raise RuntimeError(
            f"ClientConnection: cannot handle {trigger.value!r} in phase {phase.value!r}"
        ) from None
