"""The errors the serving loop answers by itself: what only a clock or a
connection count can tell (a slow client, a full server, a shutdown), and
a 500 for a handler's bug."""

from __future__ import annotations

from meshnet_proto import CapacityError, ErrorCode, MeshnetError, ProtocolError

__all__ = ["internal_error", "request_timeout", "shutting_down", "too_many"]


def too_many(retry_after: int) -> CapacityError:
    return CapacityError(
        "too many concurrent connections",
        code=ErrorCode.TOO_MANY_CONNECTIONS,
        retry_after=retry_after,
    )


def shutting_down(retry_after: int) -> CapacityError:
    return CapacityError(
        "server is shutting down", code=ErrorCode.SHUTTING_DOWN, retry_after=retry_after
    )


def request_timeout(what: str) -> ProtocolError:
    return ProtocolError(
        f"client too slow to send its request {what}", code=ErrorCode.REQUEST_TIMEOUT
    )


def internal_error() -> MeshnetError:
    return MeshnetError("internal server error", code=ErrorCode.INTERNAL_ERROR)
