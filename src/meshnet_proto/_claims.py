"""What a chunk's headers may claim about its session (wire-2 §3, §3.9),
checked before the chunk is routed: the sequencing headers a node needs,
the session's owner key, and the rules on replays and omitted positions.

Pure functions of the headers and the session record; they raise the
wire-2 error a peer gets and change nothing.
"""

from __future__ import annotations

import hmac

from ._errors import ErrorCode, ProtocolError, SequencingError
from ._routing import Headers, Session

__all__ = ["SESSION", "INDEX", "require", "check_owner", "check_claims", "unknown"]

SESSION = "x-meshnet-session"
INDEX = "x-meshnet-chunk-index"
_TOTAL = "x-meshnet-chunk-total"
_POSITION = "x-meshnet-position"
_KEY = "x-meshnet-session-key"


def require(h: Headers) -> tuple[str, int, int]:
    """A node needs the sequencing headers (the gateway's input may lack them)."""
    for value, header in ((h.session, SESSION), (h.chunk_index, INDEX), (h.chunk_total, _TOTAL)):
        if value is None:
            raise ProtocolError(
                f"{header} is required", code=ErrorCode.MISSING_HEADER, header=header
            )
    assert h.session is not None and h.chunk_index is not None and h.chunk_total is not None
    if h.chunk_index >= h.chunk_total:
        raise ProtocolError(
            f"chunk index {h.chunk_index} is not below chunk total {h.chunk_total}",
            code=ErrorCode.BAD_CHUNK_INDEX,
            header=INDEX,
        )
    return h.session, h.chunk_index, h.chunk_total


def check_owner(s: Session, key: str | None) -> None:
    """wire-2 §3.9: a keyed session is its key holder's; an unkeyed one stays
    unkeyed. Constant-time, and the message never shows a key."""
    if s.key is None and key is None:
        return
    if s.key is None:
        why = "was created without a key; a key cannot be added later"
    elif key is None:
        why = "is bound to a session key and this request carries none"
    elif hmac.compare_digest(s.key, key):
        return
    else:
        why = "is bound to another session key"
    raise ProtocolError(f"session {s.id} {why}", code=ErrorCode.SESSION_FORBIDDEN, header=_KEY)


def check_claims(s: Session | None, sid: str, index: int, h: Headers, replay: bool) -> None:
    """What a chunk may claim about a session before it is routed (wire-2 §3.9):
    its owner's key; a replay never restarts a live session; only a session's
    very first chunk may leave its position to the node."""
    if s is not None:
        check_owner(s, h.session_key)
        if replay and index == 0 and not h.position:
            raise SequencingError(
                f"session {sid} is live here: a replay cannot start it again "
                "(DELETE it first to rebuild it)",
                code=ErrorCode.SESSION_EXISTS,
                header=SESSION,
            )
    if h.position is None and (index > 0 or s is not None):
        raise SequencingError(
            f"session {sid}: chunk {index} carries no position; only the first chunk of a "
            "new session may omit it",
            code=ErrorCode.POSITION_REQUIRED,
            header=_POSITION,
        )


def unknown(message: str) -> SequencingError:
    """The 409 for a chunk of a session this node does not hold."""
    return SequencingError(message, code=ErrorCode.SESSION_UNKNOWN, header=SESSION)
