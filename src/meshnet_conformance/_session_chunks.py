"""wire-2 §3's chunk of a session, and what an answer at a position is.

Shared by the §3 checks (``s3_sessions``, ``s3_owners``, ``s3_kv`` and the
checks refused from the head).
"""

from __future__ import annotations

from collections.abc import Callable

import zstandard

from ._case import Context, expect_error, expect_tensor, float32_body, new_session
from ._wire import CheckFailed, Response


def _chunk(
    ctx: Context,
    session: str | None,
    index: int = 0,
    total: int = 1,
    *,
    position: int | None = None,
    tokens: int = 2,
    seed: int = 0,
    zstd: bool = False,
    deadline_ms: int | None = None,
    dtype: str = "float32",
    key: str | None = None,
    path: str = "/forward",
) -> bytes:
    headers = ctx.forward_headers(
        tokens,
        session=session,
        index=index,
        total=total,
        position=position,
        encoding="zstd" if zstd else None,
        dtype=dtype,
    )
    if deadline_ms is not None:
        headers.append(("X-Meshnet-Deadline-Ms", str(deadline_ms)))
    if key is not None:
        headers.append(("X-Meshnet-Session-Key", key))
    body = float32_body(tokens, seed) if dtype == "float32" else bytes(2 * 4 * tokens)
    if zstd:
        body = zstandard.ZstdCompressor(level=3).compress(body)
    return ctx.request("POST", path, headers, body)


def _position(response: Response) -> int:
    value = response.header("x-meshnet-position")
    if value is None or not value.isdigit():
        raise CheckFailed(f"response X-Meshnet-Position is {value!r}")
    return int(value)


def _expect_at(response: Response, position: int, tokens: int = 2) -> Response:
    expect_tensor(response, shape=f"1,{tokens},4")
    if _position(response) != position:
        raise CheckFailed(f"expected X-Meshnet-Position {position}, got {_position(response)}")
    return response


def refused_from_head(
    ctx: Context, request: Callable[[str | None], bytes], code: str, header: str
) -> None:
    """``request(session)`` (a fresh session at a node, None at a gateway) is
    400 ``code`` naming ``header``, and leaves nothing: at a node the session
    then starts afresh at position 0."""
    session = new_session() if ctx.role == "node" else None
    expect_error(ctx.send(request(session)), 400, code, header=header)
    if session is not None:
        _expect_at(ctx.send(_chunk(ctx, session, position=0, seed=1)), 0)
