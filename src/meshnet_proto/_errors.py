"""One error hierarchy for everything the wire-2 core rejects.

Every rejection carries what a driver needs to answer it without thinking:
the HTTP status (wire-2 §4), a stable machine-readable ``code``, the offending
header (lowercase) when there is one, and a message a person understands.
The codes are part of the public contract: they are listed in
``docs/protocol.md`` and never renamed.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "MeshnetError",
    "ProtocolError",
    "SequencingError",
    "CapacityError",
    "DownstreamError",
    "error_body",
]


class MeshnetError(Exception):
    """Base of every error the core raises.

    ``status`` is the HTTP status a server should answer with; ``code`` is the
    stable error code; ``header`` names the offending header (lowercase) or is
    ``None``; ``hop`` names the downstream that failed (wire-2 §4) or is ``None``;
    ``retry_after`` is the seconds hint for 503 answers.
    """

    default_status = 400

    def __init__(
        self,
        message: str,
        *,
        code: str,
        status: int | None = None,
        header: str | None = None,
        hop: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = self.default_status if status is None else status
        self.header = header.lower() if header is not None else None
        self.hop = hop
        self.retry_after = retry_after

    def to_dict(self) -> dict[str, Any]:
        """The wire-2 §4 JSON error object."""
        return {
            "error": {
                "status": self.status,
                "code": self.code,
                "message": self.message,
                "header": self.header,
                "hop": self.hop,
            }
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(status={self.status}, code={self.code!r}, "
            f"header={self.header!r}, message={self.message!r})"
        )


class ProtocolError(MeshnetError):
    """Malformed or unacceptable input: framing, headers, body (4xx)."""


class SequencingError(MeshnetError):
    """A chunk that does not fit its session's sequence (wire-2 §3, mostly 409)."""

    default_status = 409


class CapacityError(MeshnetError):
    """A limit of this node is reached: table full, shutting down (503)."""

    default_status = 503


class DownstreamError(MeshnetError):
    """The downstream hop failed: unreachable, garbage, timeout (502/504)."""

    default_status = 502


def error_body(error: MeshnetError) -> bytes:
    """Serialise ``error`` as the wire-2 §4 JSON body (UTF-8, compact)."""
    return json.dumps(error.to_dict(), separators=(",", ":")).encode()
