"""meshnet_proto: the sans-IO core of meshnet's wire 2.

Bytes go in, events come out; events go in, bytes come out. Nothing here
opens a socket, starts a thread, runs an event loop or reads a clock: time is
an argument wherever it matters. See ``docs/core-api.md`` for the contract.

The names below are the public API, all an embedder writing a wire-2 server
or client needs: the two connections and their events, the headers, the
sequencer and its decisions, the gateway's session table, the errors and
their codes, the limits, the codec and the sender's policies, the chain check.
They are typed (``py.typed``). ``meshnet_proto.lowlevel`` holds what a node
or gateway builds on beyond them; everything else stays in the private
``_modules`` that own it.
"""

from ._client import ClientConnection
from ._client_sessions import ClientSessionTable
from ._codec import encode_tensor
from ._errors import (
    CapacityError,
    DownstreamError,
    ErrorCode,
    MeshnetError,
    ProtocolError,
    SequencingError,
)
from ._events import (
    NEED_DATA,
    PAUSED,
    ActivationHead,
    ActivationReceived,
    ActivationResponse,
    ConnectionClosed,
    EndpointRequest,
    ErrorResponse,
    ProtocolErrorReceived,
    Response,
)
from ._headers import WireHeaders
from ._limits import Limits
from ._policy import EncodingPolicy, WireDtypePolicy, encode_for_wire
from ._sequencer import Join, Process, Reforward, Replay, SessionTable, Wait, tensor_fingerprint
from ._server import ServerConnection
from ._topology import chain_from_health, check_chain

WIRE_VERSION = 2

__version__ = "0.1.0"

__all__ = [
    # connections and their events
    "ServerConnection",
    "ClientConnection",
    "NEED_DATA",
    "PAUSED",
    "ActivationHead",
    "ActivationReceived",
    "EndpointRequest",
    "ProtocolErrorReceived",
    "ConnectionClosed",
    "ActivationResponse",
    "ErrorResponse",
    "Response",
    # the message
    "WIRE_VERSION",
    "WireHeaders",
    "Limits",
    "encode_tensor",
    "encode_for_wire",
    "WireDtypePolicy",
    "EncodingPolicy",
    # sessions: a node's sequencer and its decisions, the gateway's table
    "SessionTable",
    "tensor_fingerprint",
    "Process",
    "Wait",
    "Replay",
    "Reforward",
    "Join",
    "ClientSessionTable",
    # errors
    "ErrorCode",
    "MeshnetError",
    "ProtocolError",
    "SequencingError",
    "CapacityError",
    "DownstreamError",
    # the chain check (wire-2 §6.2)
    "chain_from_health",
    "check_chain",
]
