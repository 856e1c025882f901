"""wire-2 §3.15: whom a session serves — ``X-Meshnet-Client`` and
``X-Meshnet-Cache-Salt``: their grammar (both roles: refused from the head,
nothing changed) and that they are request-only (an answer never carries
them)."""

from __future__ import annotations

from ._case import (
    BOTH,
    HIDDEN,
    Case,
    Context,
    expect_tensor,
    float32_body,
    new_session,
)
from ._session_chunks import refused_from_head
from ._wire import CheckFailed

SECTION = "3"
NAME = "0123456789abcdef" * 2


def _with(ctx: Context, session: str | None, *pairs: tuple[str, str]) -> bytes:
    """A two-token chunk of ``session`` (None at a gateway) carrying ``pairs``."""
    headers = ctx.forward_headers(session=session, position=0 if session else None)
    return ctx.request("POST", "/forward", [*headers, *pairs], float32_body(2, 0))


def _refused_case(id: str, header: str, value: str, code: str) -> Case:
    def check(ctx: Context) -> None:
        refused_from_head(
            ctx, lambda session: _with(ctx, session, (header, value)), code, header.lower()
        )

    return Case(
        f"3.client.{id}",
        SECTION,
        f"{header}: {value!r} is 400 {code} naming it, and changes nothing",
        check,
        BOTH,
    )


def _request_only(ctx: Context) -> None:
    session = new_session() if ctx.role == "node" else None
    pairs = (("X-Meshnet-Client", NAME), ("X-Meshnet-Cache-Salt", NAME))
    response = ctx.send(_with(ctx, session, *pairs))
    expect_tensor(response, shape=f"1,2,{HIDDEN}")
    for name in ("x-meshnet-client", "x-meshnet-cache-salt"):
        if response.all(name):
            raise CheckFailed(f"an answer never carries {name} (request-only, §3.15)")


CASES: list[Case] = [
    _refused_case("client-uppercase", "X-Meshnet-Client", NAME.upper(), "bad_session"),
    _refused_case("client-short", "X-Meshnet-Client", NAME[:31], "bad_session"),
    _refused_case("salt-not-hex", "X-Meshnet-Cache-Salt", "z" * 32, "bad_prefix"),
    _refused_case("salt-long", "X-Meshnet-Cache-Salt", NAME + "0", "bad_prefix"),
    Case(
        "3.client.request-only",
        SECTION,
        "a chunk with both headers is served, and the answer carries neither",
        _request_only,
        BOTH,
    ),
]
