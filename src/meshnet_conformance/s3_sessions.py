"""wire-2 §3: sessions, runs, positions, waiting, replay, ending a session."""

from __future__ import annotations

import re

import zstandard

from ._case import (
    GATEWAY,
    NODE,
    Case,
    Context,
    expect_error,
    expect_status,
    float32_body,
    new_session,
)
from ._session_chunks import _chunk, _expect_at
from ._wire import CheckFailed, Connection, Response
from .s3_owners import OWNER_CASES

SECTION = "3"
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# Short enough to keep the checker quick, long enough for a loaded server to
# answer the predecessor first.
WAIT_DEADLINE_MS = 300


# A position far ahead: never impossible for a chunk that waits, never reached.
FAR = 10**9


def _expect_names(response: Response, session: str, index: int, total: int) -> None:
    """A node's 200 names the chunk it answers (the gateway checks it, §3.7)."""
    wanted = {
        "x-meshnet-session": session,
        "x-meshnet-chunk-index": str(index),
        "x-meshnet-chunk-total": str(total),
    }
    for name, value in wanted.items():
        if response.all(name) != [value]:
            raise CheckFailed(f"response {name}: expected {value!r}, got {response.all(name)}")


def _runs(ctx: Context) -> None:
    session = new_session()
    first = _expect_at(ctx.send(_chunk(ctx, session, 0, 2, position=0)), 0)
    _expect_names(first, session, 0, 2)
    second = _expect_at(ctx.send(_chunk(ctx, session, 1, 2, position=2, seed=1)), 2)
    _expect_names(second, session, 1, 2)
    # A finished run may be followed by a new run with another total.
    _expect_at(ctx.send(_chunk(ctx, session, 0, 1, position=4, seed=2)), 4)


def _position_omitted(ctx: Context) -> None:
    _expect_at(ctx.send(_chunk(ctx, new_session())), 0)


def _position_required(ctx: Context) -> None:
    session = new_session()
    _expect_at(ctx.send(_chunk(ctx, session)), 0)
    expect_error(ctx.send(_chunk(ctx, session, seed=1)), 409, "position_required")
    # Refused before anything ran: the session goes on at 2.
    _expect_at(ctx.send(_chunk(ctx, session, position=2, seed=1)), 2)


def _position_mismatch(ctx: Context) -> None:
    session = new_session()
    expect_status(ctx.send(_chunk(ctx, session, position=0)), 200)
    response = ctx.send(_chunk(ctx, session, position=7, seed=1))
    expect_error(response, 409, "position_mismatch")


def _unknown_session(ctx: Context) -> None:
    response = ctx.send(_chunk(ctx, new_session(), position=4))
    expect_error(response, 409, "session_unknown")


# No stage is this one: a model id nobody serves (a stub has no layers at all).
_NO_SUCH_STAGE = "meshnet-conformance-no-such-model/0"


def _stage_mismatch(ctx: Context) -> None:
    session = new_session()
    headers = [
        *ctx.forward_headers(2, session=session, position=0),
        ("X-Meshnet-Stage", _NO_SUCH_STAGE),
    ]
    response = ctx.send(ctx.forward(headers, float32_body(2)))
    expect_error(response, 409, "stage_mismatch", header="x-meshnet-stage")
    # Refused before anything changed: the session starts afresh at 0 (had
    # the chunk been taken, another tensor at 0 would be 409 position_mismatch).
    _expect_at(ctx.send(_chunk(ctx, session, position=0, seed=1)), 0)


def _run_mismatch(ctx: Context) -> None:
    session = new_session()
    expect_status(ctx.send(_chunk(ctx, session, 0, 3, position=0)), 200)
    changed_dtype = _chunk(ctx, session, 1, 3, position=2, dtype="bfloat16")
    expect_error(ctx.send(changed_dtype), 409, "run_mismatch")
    changed_total = _chunk(ctx, session, 1, 4, position=2, seed=1)
    expect_error(ctx.send(changed_total), 409, "run_mismatch")


def _out_of_window(ctx: Context) -> None:
    session = new_session()
    index = 1 + ctx.reorder_window  # the next index is 1: this one is `window` past it
    expect_status(ctx.send(_chunk(ctx, session, 0, index + 1, position=0)), 200)
    response = ctx.send(
        _chunk(ctx, session, index, index + 1, position=FAR, deadline_ms=WAIT_DEADLINE_MS)
    )
    expect_error(response, 409, "chunk_out_of_window")


def _replay(ctx: Context) -> None:
    session = new_session()
    first = _expect_at(ctx.send(_chunk(ctx, session, 0, 2, position=0)), 0)
    again = _expect_at(ctx.send(_chunk(ctx, session, 0, 2, position=0)), 0)
    if again.body != first.body:
        raise CheckFailed("the replayed answer's body differs from the original's")


def _replay_other_encoding(ctx: Context) -> None:
    session = new_session()
    first = _expect_at(ctx.send(_chunk(ctx, session, 0, 2, position=0)), 0)
    again = ctx.send(_chunk(ctx, session, 0, 2, position=0, zstd=True))
    expect_status(again, 200)
    body = again.body
    if (again.header("x-meshnet-encoding") or "identity") == "zstd":
        body = zstandard.ZstdDecompressor().decompress(body, max_output_size=len(first.body))
    if body != first.body:
        raise CheckFailed("the same tensor sent zstd-encoded was not answered as a replay")


def _replay_last_run(ctx: Context) -> None:
    session = new_session()
    first = _expect_at(ctx.send(_chunk(ctx, session, 0, 1, position=0)), 0)
    again = _expect_at(ctx.send(_chunk(ctx, session, 0, 1, position=0)), 0)
    if again.body != first.body:
        raise CheckFailed("the last finished run's chunk was not replayed")
    # The replay did not advance the session: the next run still starts at 2.
    _expect_at(ctx.send(_chunk(ctx, session, 0, 1, position=2, seed=1)), 2)


def _conflict(ctx: Context) -> None:
    session = new_session()
    expect_status(ctx.send(_chunk(ctx, session, 0, 2, position=0)), 200)
    response = ctx.send(_chunk(ctx, session, 0, 2, position=0, seed=9))
    expect_error(response, 409, "chunk_conflict")


def _wait_for_predecessor(ctx: Context) -> None:
    session = new_session()
    with ctx.connect() as early, ctx.connect() as late:
        early.send(_chunk(ctx, session, 1, 2, position=2, seed=1))
        _expect_at(late.exchange(_chunk(ctx, session, 0, 2, position=0)), 0)
        _expect_at(early.read_response(), 2)


def _wait_times_out(ctx: Context) -> None:
    session = new_session()
    expect_status(ctx.send(_chunk(ctx, session, 0, 3, position=0)), 200)
    response = ctx.send(_chunk(ctx, session, 2, 3, position=FAR, deadline_ms=WAIT_DEADLINE_MS))
    expect_error(response, 409, "chunk_wait_timeout")


def _wait_never_started(ctx: Context) -> None:
    response = ctx.send(
        _chunk(ctx, new_session(), 1, 2, position=FAR, deadline_ms=WAIT_DEADLINE_MS)
    )
    expect_error(response, 409, "session_unknown")


def _delete(ctx: Context) -> None:
    session = new_session()
    expect_status(ctx.send(_chunk(ctx, session, 0, 1, position=0)), 200)
    expect_status(ctx.send(ctx.request("DELETE", f"/sessions/{session}")), 204)
    expect_error(ctx.send(ctx.request("DELETE", f"/sessions/{session}")), 404, "not_found")
    expect_error(ctx.send(_chunk(ctx, session, 0, 1, position=2)), 409, "session_unknown")


def _gateway_session(ctx: Context) -> None:
    with ctx.connect() as conn:
        first = _expect_at(conn.exchange(_chunk(ctx, None)), 0)
        session = first.header("x-meshnet-session") or ""
        if _UUID.fullmatch(session) is None:
            raise CheckFailed(f"the gateway's minted session {session!r} is not a UUID")
        # wire-2 §3.9: the key it minted comes with the answer that made it.
        key = first.header("x-meshnet-session-key") or ""
        _expect_at(conn.exchange(_chunk(ctx, session, seed=1, key=key)), 2)
        mismatch = conn.exchange(_chunk(ctx, session, position=99, seed=2, key=key))
    expect_error(mismatch, 409, "position_mismatch")
    delete = ("DELETE", f"/sessions/{session}", [("X-Meshnet-Session-Key", key)])
    expect_status(ctx.send(ctx.request(*delete)), 204)
    expect_error(ctx.send(ctx.request(*delete)), 404, "not_found")


def _keep_alive(ctx: Context) -> None:
    with ctx.connect() as conn:
        _check_two(conn, ctx)


def _check_two(conn: Connection, ctx: Context) -> None:
    session = new_session() if ctx.role == "node" else None
    first = conn.exchange(_chunk(ctx, session, position=0))
    _expect_at(first, 0)
    session = first.header("x-meshnet-session") or session
    key = first.header("x-meshnet-session-key")  # a gateway's minted key (wire-2 §3.9)
    _expect_at(conn.exchange(_chunk(ctx, session, position=2, seed=1, key=key)), 2)


CASES: list[Case] = [
    Case(
        "3.runs",
        SECTION,
        "chunks of a run in order are answered with their session, index, "
        "total and position; a finished run is followed by a new run with another total",
        _runs,
        NODE,
    ),
    Case(
        "3.position-omitted",
        SECTION,
        "a new session's first chunk without X-Meshnet-Position starts at 0 and answers it",
        _position_omitted,
        NODE,
    ),
    Case(
        "3.position-required",
        SECTION,
        "any other chunk without X-Meshnet-Position is 409 "
        "position_required, and the session is intact",
        _position_required,
        NODE,
    ),
    Case(
        "3.keep-alive",
        SECTION,
        "two messages of one session on one keep-alive connection",
        _keep_alive,
    ),
    Case(
        "3.position-mismatch",
        SECTION,
        "a position other than the session's is 409 position_mismatch",
        _position_mismatch,
        NODE,
    ),
    Case(
        "3.unknown-session",
        SECTION,
        "index 0 at position > 0 of an unknown session is 409 session_unknown at once",
        _unknown_session,
        NODE,
    ),
    Case(
        "3.stage-mismatch",
        SECTION,
        "a chunk whose X-Meshnet-Stage names a stage this node "
        "is not is 409 stage_mismatch, from the head, and changes nothing",
        _stage_mismatch,
        NODE,
    ),
    Case(
        "3.run-mismatch",
        SECTION,
        "a changed dtype or total within a run is 409 run_mismatch",
        _run_mismatch,
        NODE,
    ),
    Case(
        "3.out-of-window",
        SECTION,
        "an index a whole reorder window ahead is 409 chunk_out_of_window",
        _out_of_window,
        NODE,
    ),
    Case(
        "3.wait",
        SECTION,
        "a chunk sent before its predecessor waits for it and is then served",
        _wait_for_predecessor,
        NODE,
    ),
    Case(
        "3.wait-deadline",
        SECTION,
        "a wait ends at the request's deadline with 409 chunk_wait_timeout",
        _wait_times_out,
        NODE,
    ),
    Case(
        "3.wait-never-started",
        SECTION,
        "a wait for a session that never starts ends with 409 session_unknown",
        _wait_never_started,
        NODE,
    ),
    Case(
        "3.replay",
        SECTION,
        "an identical retransmission is answered with the stored answer",
        _replay,
        NODE,
    ),
    Case(
        "3.replay-encoding",
        SECTION,
        "a retransmission is identical by decoded tensor: the encoding may differ",
        _replay_other_encoding,
        NODE,
    ),
    Case(
        "3.replay-last-run",
        SECTION,
        "a retransmission of the last finished run's chunk is "
        "a replay and does not advance the position",
        _replay_last_run,
        NODE,
    ),
    Case(
        "3.conflict",
        SECTION,
        "an index already passed with a different tensor is 409 chunk_conflict",
        _conflict,
        NODE,
    ),
    Case(
        "3.delete",
        SECTION,
        "DELETE /sessions/{id} is 204, then 404; the session is gone (409 session_unknown)",
        _delete,
        NODE,
    ),
    *OWNER_CASES,
    Case(
        "3.gateway-session",
        SECTION,
        "the gateway mints a session, continues it at its "
        "position, refuses another position (409), deletes it (204, then 404)",
        _gateway_session,
        GATEWAY,
    ),
]
