"""One error hierarchy for everything the wire-2 core rejects.

Every rejection carries what a driver needs to answer it without thinking:
the HTTP status (wire-2 §4), a stable machine-readable ``code``, the offending
header (lowercase) when there is one, and a message a person understands.
The codes are part of the public contract: `ErrorCode` names every one
with its status (wire-2 §4.2; docs/core-api.md says when each is used), and
none is ever renamed.
"""

from __future__ import annotations

import enum
import json
from typing import Any, Self

__all__ = [
    "ErrorCode",
    "MeshnetError",
    "ProtocolError",
    "SequencingError",
    "CapacityError",
    "DownstreamError",
    "error_body",
]


class ErrorCode(enum.StrEnum):
    """Every stable error code (wire-2 §4.2), with the status it is answered with.

    A member *is* its string (``ErrorCode.NOT_FOUND == "not_found"``), so it
    goes wherever a ``code`` does, and a code read off the wire compares equal
    to it. ``status`` is the contract's status; ``statuses`` every status
    meshnet raises the code with, the contract's among them: only
    ``bad_chunk_index`` has two (400 for a request's header, 502 when the
    gateway's reassembler is handed an index outside its run: the
    downstream's fault). A relayed error keeps its downstream's status
    (wire-2 §4.3) whatever its code; ``downstream_bad_response`` in
    particular may then come with any 4xx or 5xx but 500.
    """

    # The status wire-2 §4.2 gives the code, then any other it is raised with.
    _status: int
    _also: tuple[int, ...]

    # 400
    MALFORMED_REQUEST = "malformed_request", 400
    BAD_FRAMING = "bad_framing", 400
    MISSING_HEADER = "missing_header", 400
    DUPLICATE_HEADER = "duplicate_header", 400
    BAD_INTEGER = "bad_integer", 400
    BAD_SHAPE = "bad_shape", 400
    BAD_DTYPE = "bad_dtype", 400
    BAD_ENCODING = "bad_encoding", 400
    BAD_SESSION = "bad_session", 400
    BAD_SESSION_KEY = "bad_session_key", 400
    BAD_CHUNK_INDEX = "bad_chunk_index", 400, 502
    BAD_STAGE = "bad_stage", 400
    BAD_PREFIX = "bad_prefix", 400
    BAD_SAMPLE = "bad_sample", 400
    BAD_KV = "bad_kv", 400
    BAD_DRAFT = "bad_draft", 400
    BAD_AFTER = "bad_after", 400
    WIRE_VERSION_MISMATCH = "wire_version_mismatch", 400
    BODY_SIZE_MISMATCH = "body_size_mismatch", 400
    BAD_ZSTD_FRAME = "bad_zstd_frame", 400
    BAD_REQUEST = "bad_request", 400
    FLOAT16_OVERFLOW = "float16_overflow", 400
    BFLOAT16_OVERFLOW = "bfloat16_overflow", 400
    BAD_STAGE_INPUT = "bad_stage_input", 400
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded", 400
    # 401
    UNAUTHORIZED = "unauthorized", 401
    # 403
    SESSION_FORBIDDEN = "session_forbidden", 403
    KEY_NOT_ALLOWED = "key_not_allowed", 403
    HOST_NOT_ALLOWED = "host_not_allowed", 403
    ORIGIN_NOT_ALLOWED = "origin_not_allowed", 403
    # 404
    NOT_FOUND = "not_found", 404
    # 405
    METHOD_NOT_ALLOWED = "method_not_allowed", 405
    # 408
    REQUEST_TIMEOUT = "request_timeout", 408
    # 409
    SESSION_UNKNOWN = "session_unknown", 409
    CHUNK_WAIT_TIMEOUT = "chunk_wait_timeout", 409
    CHUNK_OUT_OF_WINDOW = "chunk_out_of_window", 409
    RUN_MISMATCH = "run_mismatch", 409
    POSITION_MISMATCH = "position_mismatch", 409
    CHUNK_CONFLICT = "chunk_conflict", 409
    SESSION_EXISTS = "session_exists", 409
    POSITION_REQUIRED = "position_required", 409
    SESSION_BUSY = "session_busy", 409
    STAGE_MISMATCH = "stage_mismatch", 409
    KV_CACHE_MISMATCH = "kv_cache_mismatch", 409
    PREFIX_UNKNOWN = "prefix_unknown", 409
    KV_UNSUPPORTED = "kv_unsupported", 409
    WINDOW_STALE = "window_stale", 409
    REWIND_REFUSED = "rewind_refused", 409
    # 411
    LENGTH_REQUIRED = "length_required", 411
    # 413
    TENSOR_TOO_LARGE = "tensor_too_large", 413
    BODY_TOO_LARGE = "body_too_large", 413
    CHUNK_TOO_LARGE = "chunk_too_large", 413
    # 415
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type", 415
    WIRE1_GONE = "wire1_gone", 415
    UNSUPPORTED_DTYPE = "unsupported_dtype", 415
    UNSUPPORTED_ENCODING = "unsupported_encoding", 415
    # 429
    CLIENT_SESSIONS_FULL = "client_sessions_full", 429
    # 431
    HEADER_BLOCK_TOO_LARGE = "header_block_too_large", 431
    # 500
    INTERNAL_ERROR = "internal_error", 500
    # 502
    DOWNSTREAM_UNREACHABLE = "downstream_unreachable", 502
    DOWNSTREAM_BAD_RESPONSE = "downstream_bad_response", 502
    CHUNK_MISSING = "chunk_missing", 502
    CHUNK_DUPLICATE = "chunk_duplicate", 502
    CHUNK_MISMATCH = "chunk_mismatch", 502
    NO_REPLICA = "no_replica", 502
    SESSION_LOST = "session_lost", 502
    REPLAY_FAILED = "replay_failed", 502
    STAGE_DOWN = "stage_down", 502
    # 503
    SESSIONS_FULL = "sessions_full", 503
    SHUTTING_DOWN = "shutting_down", 503
    TOO_MANY_CONNECTIONS = "too_many_connections", 503
    MEMORY_FULL = "memory_full", 503
    KV_MEMORY_FULL = "kv_memory_full", 503
    KV_TRANSFERS_FULL = "kv_transfers_full", 503
    STAGE_BUSY = "stage_busy", 503
    CHAIN_MISMATCH = "chain_mismatch", 503
    GATEWAY_BUSY = "gateway_busy", 503
    # 504
    DOWNSTREAM_TIMEOUT = "downstream_timeout", 504
    DEADLINE_EXCEEDED = "deadline_exceeded", 504

    def __new__(cls, value: str, status: int, *also: int) -> Self:
        member = str.__new__(cls, value)
        member._value_ = value
        member._status = status
        member._also = also
        return member

    @property
    def status(self) -> int:
        """The HTTP status wire-2 §4.2 gives this code."""
        return self._status

    @property
    def statuses(self) -> frozenset[int]:
        """Every status meshnet answers this code with (``status`` among them)."""
        return frozenset((self._status, *self._also))


class MeshnetError(Exception):
    """Base of every error the core raises.

    ``status`` is the HTTP status a server should answer with; ``code`` is the
    stable error code; ``header`` names the offending header (lowercase) or is
    ``None``; ``hop`` names the downstream that failed (wire-2 §4) or is ``None``;
    ``retry_after`` is the seconds hint for 503 answers.

    A raise site names an `ErrorCode` and the status follows from it (its
    ``status``), the way h11's ``error_status_hint`` travels with its error:
    ``status=`` is given only for a code's other status (``bad_chunk_index``'s
    502). A plain string is for a code relayed off the wire (wire-2 §4.3),
    which may be one this version does not know: it comes with its
    downstream's status, or else gets the class's ``default_status``.
    """

    default_status = 400

    def __init__(
        self,
        message: str,
        *,
        code: ErrorCode | str,
        status: int | None = None,
        header: str | None = None,
        hop: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        if status is None:
            status = code.status if isinstance(code, ErrorCode) else self.default_status
        self.status = status
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
            f"{type(self).__name__}(status={self.status}, code={str(self.code)!r}, "
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
