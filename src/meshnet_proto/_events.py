"""What a connection hands its driver: events and the two "no event" sentinels.

A driver feeds bytes into a `ServerConnection` or `ClientConnection` and asks
``next_event()`` for what they meant. The answer is one of the frozen,
slotted, keyword-only dataclasses below, or a sentinel:

* `NEED_DATA` — nothing complete yet: read from the transport and feed it.
* `PAUSED` — the peer's side of this exchange is complete and it is the
  driver's turn to answer (reading more would only buffer the next request).

Events validate their fields in the constructor, as h11's do, so a
hand-built event in a test or a driver cannot carry nonsense; the cost is a
few ``isinstance`` checks per message, never a pass over a tensor.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import numpy as np

from ._errors import DownstreamError, MeshnetError
from ._headers import WireHeaders
from ._kv import is_kv_import
from ._slots import slot_setters

__all__ = [
    "NEED_DATA",
    "PAUSED",
    "ActivationHead",
    "ActivationReceived",
    "ActivationResponse",
    "ConnectionClosed",
    "EndpointRequest",
    "ErrorResponse",
    "Event",
    "ProtocolErrorReceived",
    "Response",
    "Sentinel",
]


class Sentinel(enum.Enum):
    """The two answers of ``next_event()`` that are not events."""

    NEED_DATA = "NEED_DATA"
    PAUSED = "PAUSED"

    def __repr__(self) -> str:
        return self.value


NEED_DATA: Final = Sentinel.NEED_DATA
PAUSED: Final = Sentinel.PAUSED

NeedData = Literal[Sentinel.NEED_DATA]
Paused = Literal[Sentinel.PAUSED]

Pairs = tuple[tuple[bytes, bytes], ...]


def _check_pairs(pairs: Any, field: str) -> None:
    if not isinstance(pairs, tuple) or not all(
        isinstance(pair, tuple)
        and len(pair) == 2
        and isinstance(pair[0], bytes)
        and isinstance(pair[1], bytes)
        for pair in pairs
    ):
        raise TypeError(f"{field} must be a tuple of (bytes, bytes) pairs")


def _check_status(status: Any, low: int, high: int) -> None:
    if not isinstance(status, int) or isinstance(status, bool) or not low <= status <= high:
        raise ValueError(f"status must be an int in {low}..{high}, got {status!r}")


def _check_query(query: Any) -> None:
    if not isinstance(query, str):
        raise TypeError("query must be a str")


def is_replay(query: str) -> bool:
    """wire-2 §3.8: ``replay=1`` among the query's ``&``-separated parameters."""
    return "replay=1" in query.split("&")


def _check_buffer(body: Any, field: str) -> None:
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise TypeError(f"{field} must be bytes, bytearray or memoryview")


# ---------------------------------------------------------------- server side


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationHead:
    """A valid wire-2 activation head (``POST /forward``), body not yet read.

    Everything wire-2 §2 checks on a head has passed: credentials, method,
    framing, content type, header values, tensor size and — when the length
    is known — the body's bound. The driver now runs the sequencing checks
    that need only headers and either rejects with ``send_error()`` (the
    connection then closes, because the body was not read) or calls
    ``next_event()`` again to read the body — writing ``send_continue()``'s
    bytes first when ``expects_continue`` is true, or the client will wait.
    """

    headers: WireHeaders
    expects_continue: bool
    # The request target's query (after "?"): a hop's replay to a new
    # replica is ``/forward?replay=1`` (docs/failover.md).
    query: str = ""
    # ``replay=1`` among the query's parameters (wire-2 §3.8): read once, here.
    replay: bool = field(init=False)
    # ``kv=1``: a KV import (wire-2 §3.11), neither a chunk nor a replay.
    kv_import: bool = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.headers, WireHeaders):
            raise TypeError("headers must be a WireHeaders")
        if not isinstance(self.expects_continue, bool):
            raise TypeError("expects_continue must be a bool")
        _check_query(self.query)
        object.__setattr__(self, "replay", is_replay(self.query))
        object.__setattr__(self, "kv_import", is_kv_import(self.query))


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationReceived:
    """A complete activation: the decoded tensor (read-only, zero-copy for
    identity bodies) and the number of body bytes that crossed the wire."""

    headers: WireHeaders
    tensor: np.ndarray
    body_nbytes: int
    query: str = ""  # as on ActivationHead
    replay: bool = field(init=False)  # as on ActivationHead
    kv_import: bool = field(init=False)  # as on ActivationHead

    def __post_init__(self) -> None:
        if not isinstance(self.headers, WireHeaders):
            raise TypeError("headers must be a WireHeaders")
        if not isinstance(self.tensor, np.ndarray):
            raise TypeError("tensor must be a numpy.ndarray")
        if not isinstance(self.body_nbytes, int) or self.body_nbytes < 0:
            raise ValueError("body_nbytes must be a non-negative int")
        _check_query(self.query)
        object.__setattr__(self, "replay", is_replay(self.query))
        object.__setattr__(self, "kv_import", is_kv_import(self.query))


# The connection builds an activation's two events from values it made
# itself (parsed headers, the decoded tensor, the query it split): their
# checks, the query parsed twice more and a frozen dataclass's setattr were
# ~4 us of a decode step (section decode). Its slots are set directly.
(
    _set_head_headers,
    _set_head_continue,
    _set_head_query,
    _set_head_replay,
    _set_head_kv,
) = slot_setters(ActivationHead, ("headers", "expects_continue", "query", "replay", "kv_import"))
(
    _set_received_headers,
    _set_received_tensor,
    _set_received_nbytes,
    _set_received_query,
    _set_received_replay,
    _set_received_kv,
) = slot_setters(
    ActivationReceived, ("headers", "tensor", "body_nbytes", "query", "replay", "kv_import")
)


def activation_head(
    headers: WireHeaders, expects_continue: bool, query: str, replay: bool, kv_import: bool
) -> ActivationHead:
    """An `ActivationHead` the connection has checked: equal to building it
    the public way (``replay`` and ``kv_import`` as read off ``query``),
    without checking again."""
    event = object.__new__(ActivationHead)
    _set_head_headers(event, headers)
    _set_head_continue(event, expects_continue)
    _set_head_query(event, query)
    _set_head_replay(event, replay)
    _set_head_kv(event, kv_import)
    return event


def activation_received(
    head: ActivationHead, tensor: np.ndarray, body_nbytes: int
) -> ActivationReceived:
    """The `ActivationReceived` completing ``head``, as `activation_head`."""
    event = object.__new__(ActivationReceived)
    _set_received_headers(event, head.headers)
    _set_received_tensor(event, tensor)
    _set_received_nbytes(event, body_nbytes)
    _set_received_query(event, head.query)
    _set_received_replay(event, head.replay)
    _set_received_kv(event, head.kv_import)
    return event


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointRequest:
    """Any request that is not an activation (``/health``, ``/info``,
    ``/metrics``, ``DELETE /sessions/{id}``), body read and capped.

    ``headers`` are h11's: lowercase names, raw values, in arrival order.
    ``query`` is the raw text after ``?`` (empty when there is none).
    ``route`` is the key of the connection's route table that ``path``
    matched (``"/sessions/*"`` for ``/sessions/abc``): the one routing
    decision, which an application dispatches on instead of matching
    paths again.
    """

    method: str
    path: str
    query: str
    headers: Pairs
    body: bytes
    route: str = ""
    # ``replay=1`` among the query's parameters: a ``DELETE /sessions/{id}``
    # that ends a stale copy here only (wire-2 §3.8), as on ActivationHead.
    replay: bool = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise ValueError("method must be a non-empty str")
        if not isinstance(self.path, str) or not self.path.startswith("/"):
            raise ValueError("path must be a str starting with '/'")
        if not isinstance(self.query, str):
            raise TypeError("query must be a str")
        _check_pairs(self.headers, "headers")
        if not isinstance(self.body, bytes):
            raise TypeError("body must be bytes")
        if not isinstance(self.route, str):
            raise TypeError("route must be a str")
        object.__setattr__(self, "replay", is_replay(self.query))


@dataclass(frozen=True, slots=True, kw_only=True)
class ProtocolErrorReceived:
    """The peer sent something wire-2 §2 rejects. Answer with
    ``send_error(event.error)`` and close: the error is sticky."""

    error: MeshnetError

    def __post_init__(self) -> None:
        if not isinstance(self.error, MeshnetError):
            raise TypeError("error must be a MeshnetError")


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionClosed:
    """The exchange is over: the peer closed, or the connection must close
    now (after an error or a ``Connection: close`` answer). Close the
    transport."""


# ---------------------------------------------------------------- client side


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationResponse:
    """A downstream's ``200`` wire-2 answer to an activation.

    ``body`` is the wire body exactly as received (read-only ``memoryview``,
    still compressed when ``headers.encoding == "zstd"``), so a relaying node
    can pass it upstream untouched with ``send_activation(headers, body)``.
    ``tensor`` is the decoded tensor, or ``None`` when the client was built
    with ``decode=False``.
    """

    status: int
    headers: WireHeaders
    body: bytes | bytearray | memoryview
    tensor: np.ndarray | None

    def __post_init__(self) -> None:
        _check_status(self.status, 200, 299)
        if not isinstance(self.headers, WireHeaders):
            raise TypeError("headers must be a WireHeaders")
        _check_buffer(self.body, "body")
        if self.tensor is not None and not isinstance(self.tensor, np.ndarray):
            raise TypeError("tensor must be a numpy.ndarray or None")


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorResponse:
    """A downstream's error answer (status ≥ 400).

    ``error`` is the inner wire-2 §4 object (``status``, ``code``, ``message``,
    ``header``, ``hop``). A body that is not a valid wire-2 §4 document (an HTML
    page from a proxy, truncated JSON) still yields an ``ErrorResponse``: its
    ``error`` is synthesised with code ``downstream_bad_response`` and the
    body's first bytes as the message. ``raw`` is the body as received and
    ``retry_after`` the ``Retry-After`` seconds when the downstream sent them.
    """

    status: int
    error: dict[str, Any]
    raw: bytes
    retry_after: int | None = None

    def __post_init__(self) -> None:
        _check_status(self.status, 400, 599)
        if not isinstance(self.error, dict):
            raise TypeError("error must be a dict")
        if not isinstance(self.raw, bytes):
            raise TypeError("raw must be bytes")
        if self.retry_after is not None and (
            not isinstance(self.retry_after, int) or self.retry_after < 0
        ):
            raise ValueError("retry_after must be a non-negative int or None")

    def to_error(self, *, hop: str | None = None) -> MeshnetError:
        """The error to relay upstream with ``send_error()``.

        Status, code, message and header are the downstream's; ``hop`` is the
        downstream's own when it set one (it names a deeper node), otherwise
        ``hop`` — the relaying node's ``--next`` URL (wire-2 §4).
        """
        inner = self.error
        return DownstreamError(
            str(inner.get("message", "")),
            code=str(inner.get("code", "downstream_bad_response")),
            status=self.status,
            header=inner.get("header") if isinstance(inner.get("header"), str) else None,
            hop=inner.get("hop") if isinstance(inner.get("hop"), str) else hop,
            retry_after=self.retry_after,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Response:
    """A non-error answer to ``send_request()`` (``/health``, ``/info``, …).

    An activation's only success is a ``200`` wire-2 answer
    (`ActivationResponse`); any other non-error status to an activation is
    garbage and raises `DownstreamError`."""

    status: int
    headers: Pairs
    body: bytes

    def __post_init__(self) -> None:
        _check_status(self.status, 200, 399)
        _check_pairs(self.headers, "headers")
        if not isinstance(self.body, bytes):
            raise TypeError("body must be bytes")


Event = (
    ActivationHead
    | ActivationReceived
    | EndpointRequest
    | ProtocolErrorReceived
    | ConnectionClosed
    | ActivationResponse
    | ErrorResponse
    | Response
)
