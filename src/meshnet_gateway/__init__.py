"""meshnet_gateway: whole sequences in, chunked runs through a node chain (wire-2 §1, §3).

The client API for applications lives here too: ``forward_via_gateway`` and
``forward_via_chain`` (see ``docs/gateway.md``).
"""

from .app import GatewayApp
from .client import (
    ChunkResult,
    Client,
    ForwardResult,
    RemoteError,
    delete_session,
    forward_via_chain,
    forward_via_gateway,
)
from .server import RunningGateway, open_gateway

__all__ = [
    "ChunkResult",
    "Client",
    "ForwardResult",
    "GatewayApp",
    "RemoteError",
    "RunningGateway",
    "delete_session",
    "forward_via_chain",
    "forward_via_gateway",
    "open_gateway",
]
