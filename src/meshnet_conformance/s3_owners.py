"""wire-2 §3: a session's owner — the session key that keyed it, and nobody else."""

from __future__ import annotations

import re

from ._case import GATEWAY, NODE, Case, Context, expect_error, expect_status, new_session
from ._session_chunks import _chunk, _expect_at
from ._wire import CheckFailed, Response

SECTION = "3"

# Two session keys (wire-2 §2.3 session-key: 32 lowercase hex digits).
_KEY = "0123456789abcdef" * 2
_OTHER_KEY = "fedcba9876543210" * 2


def _keyed_session(ctx: Context) -> str:
    """A node session created with ``_KEY``, one run done (next position 2)."""
    session = new_session()
    _expect_at(ctx.send(_chunk(ctx, session, 0, 1, position=0, key=_KEY)), 0)
    return session


def _expect_forbidden(response: Response) -> None:
    error = expect_error(response, 403, "session_forbidden", header="x-meshnet-session-key")
    if _KEY in error["message"] or _OTHER_KEY in error["message"]:
        raise CheckFailed("the 403 message shows a session key")


def _still_owned(ctx: Context, session: str, position: int = 2) -> None:
    """The owner goes on where it was: the refused request changed nothing."""
    _expect_at(ctx.send(_chunk(ctx, session, 0, 1, position=position, seed=1, key=_KEY)), position)


def _wrong_key(ctx: Context) -> None:
    session = _keyed_session(ctx)
    _expect_forbidden(ctx.send(_chunk(ctx, session, 0, 1, position=2, seed=1, key=_OTHER_KEY)))
    _still_owned(ctx, session)


def _missing_key(ctx: Context) -> None:
    session = _keyed_session(ctx)
    _expect_forbidden(ctx.send(_chunk(ctx, session, 0, 1, position=2, seed=1)))
    _still_owned(ctx, session)


def _added_key(ctx: Context) -> None:
    session = new_session()
    _expect_at(ctx.send(_chunk(ctx, session, 0, 1, position=0)), 0)
    _expect_forbidden(ctx.send(_chunk(ctx, session, 0, 1, position=2, seed=1, key=_KEY)))
    _expect_at(ctx.send(_chunk(ctx, session, 0, 1, position=2, seed=1)), 2)


def _delete_needs_key(ctx: Context) -> None:
    session = _keyed_session(ctx)
    path = f"/sessions/{session}"
    _expect_forbidden(ctx.send(ctx.request("DELETE", path)))
    _expect_forbidden(
        ctx.send(ctx.request("DELETE", path, [("X-Meshnet-Session-Key", _OTHER_KEY)]))
    )
    _still_owned(ctx, session)
    expect_status(ctx.send(ctx.request("DELETE", path, [("X-Meshnet-Session-Key", _KEY)])), 204)


def _replay_live_session(ctx: Context) -> None:
    session = _keyed_session(ctx)
    # Even the owner's replay of a session's start cannot rewrite it: DELETE first.
    replay = _chunk(ctx, session, 0, 1, position=0, seed=7, key=_KEY, path="/forward?replay=1")
    expect_error(ctx.send(replay), 409, "session_exists", header="x-meshnet-session")
    _still_owned(ctx, session)


def _gateway_owner(ctx: Context) -> None:
    first = _expect_at(ctx.send(_chunk(ctx, None)), 0)
    session = first.header("x-meshnet-session") or ""
    key = first.header("x-meshnet-session-key") or ""
    if re.fullmatch(r"[0-9a-f]{32}", key) is None:
        raise CheckFailed(f"the gateway's minted session key {key!r} is not 32 lowercase hex")
    for other in (None, _OTHER_KEY if key != _OTHER_KEY else _KEY):
        refused = ctx.send(_chunk(ctx, session, position=2, seed=1, key=other))
        error = expect_error(refused, 403, "session_forbidden", header="x-meshnet-session-key")
        if key in error["message"] or refused.header("x-meshnet-session-key") is not None:
            raise CheckFailed("a refused request was told the session's key")
    delete = ("DELETE", f"/sessions/{session}")
    expect_error(ctx.send(ctx.request(*delete)), 403, "session_forbidden")
    again = _expect_at(ctx.send(_chunk(ctx, session, position=2, seed=1, key=key)), 2)
    if again.header("x-meshnet-session-key") is not None:
        raise CheckFailed("the gateway told the session key again, not only when it minted it")
    expect_status(ctx.send(ctx.request(*delete, [("X-Meshnet-Session-Key", key)])), 204)


OWNER_CASES: list[Case] = [
    Case(
        "3.owner.wrong-key",
        SECTION,
        "a chunk of a keyed session with another key is 403 "
        "session_forbidden, and the owner goes on at its position",
        _wrong_key,
        NODE,
    ),
    Case(
        "3.owner.missing-key",
        SECTION,
        "a chunk of a keyed session without its key is 403 "
        "session_forbidden, and the owner goes on at its position",
        _missing_key,
        NODE,
    ),
    Case(
        "3.owner.added-key",
        SECTION,
        "a key on a chunk of a session created without one is "
        "403 session_forbidden: a key cannot be added later",
        _added_key,
        NODE,
    ),
    Case(
        "3.owner.delete-needs-key",
        SECTION,
        "DELETE of a keyed session without its key, or "
        "with another, is 403 and the session still answers; with it, 204",
        _delete_needs_key,
        NODE,
    ),
    Case(
        "3.replay.live-session",
        SECTION,
        "a replay (?replay=1) of chunk 0 at position 0 of "
        "a session the node holds is 409 session_exists, and the session is intact",
        _replay_live_session,
        NODE,
    ),
    Case(
        "3.owner.gateway",
        SECTION,
        "the gateway mints a session key, says it once; a "
        "continuation or DELETE without it or with another is 403 session_forbidden",
        _gateway_owner,
        GATEWAY,
    ),
]
