"""wire-2 §7: bearer-token access control (run only when the checker is given the token)."""

from __future__ import annotations

from ._case import Case, Context, expect_error, expect_status, expect_tensor, float32_body
from ._wire import CheckFailed, Response

SECTION = "7"


def _refused(response: Response, ctx: Context) -> None:
    expect_error(response, 401, "unauthorized")
    if not (response.header("www-authenticate") or "").lower().startswith("bearer"):
        raise CheckFailed("a 401 must carry WWW-Authenticate: Bearer")
    assert ctx.token is not None
    if ctx.token.encode() in response.body:
        raise CheckFailed("the 401 body contains the token")


def _no_credentials(ctx: Context) -> None:
    request = ctx.forward(ctx.forward_headers(2), float32_body(2), auth=False)
    _refused(ctx.send(request), ctx)


def _wrong_token(ctx: Context) -> None:
    assert ctx.token is not None
    wrong = ctx.token[:-1] + ("x" if not ctx.token.endswith("x") else "y")
    request = ctx.forward(
        ctx.forward_headers(2),
        float32_body(2),
        auth=False,
        extra=[("Authorization", f"Bearer {wrong}")],
    )
    _refused(ctx.send(request), ctx)


def _other_scheme(ctx: Context) -> None:
    request = ctx.request(
        "GET", "/info", auth=False, extra=[("Authorization", f"Basic {ctx.token}")]
    )
    _refused(ctx.send(request), ctx)


def _before_routing(ctx: Context) -> None:
    _refused(ctx.send(ctx.request("GET", "/no-such-path", auth=False)), ctx)


def _health_open(ctx: Context) -> None:
    expect_status(ctx.send(ctx.request("GET", "/health", auth=False)), 200)


def _deep_health_needs_token(ctx: Context) -> None:
    _refused(ctx.send(ctx.request("GET", "/health?deep=1", auth=False)), ctx)


def _right_token(ctx: Context) -> None:
    response = ctx.send(ctx.forward(ctx.forward_headers(2), float32_body(2)))
    expect_tensor(response, shape="1,2,4")


CASES: list[Case] = [
    Case(
        "7.no-credentials",
        SECTION,
        "without Authorization /forward is 401 unauthorized with WWW-Authenticate: Bearer",
        _no_credentials,
        needs_token=True,
    ),
    Case(
        "7.wrong-token",
        SECTION,
        "a wrong bearer token is 401, and the answer never contains the token",
        _wrong_token,
        needs_token=True,
    ),
    Case(
        "7.other-scheme",
        SECTION,
        "the token under another scheme (Basic) is 401",
        _other_scheme,
        needs_token=True,
    ),
    Case(
        "7.before-routing",
        SECTION,
        "credentials are checked before the path: an unknown path without them is 401",
        _before_routing,
        needs_token=True,
    ),
    Case(
        "7.health-open", SECTION, "GET /health needs no credentials", _health_open, needs_token=True
    ),
    Case(
        "7.deep-health-needs-token",
        SECTION,
        "GET /health?deep=1 shows the chain: without credentials it is 401",
        _deep_health_needs_token,
        needs_token=True,
    ),
    Case("7.right-token", SECTION, "the right token is served", _right_token, needs_token=True),
]
