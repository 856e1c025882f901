"""wire-2 §4: the error body, and deadlines."""

from __future__ import annotations

from ._case import Case, Context, expect_error, float32_body
from ._wire import CheckFailed

SECTION = "4"


def _error_body(ctx: Context) -> None:
    headers = [*ctx.forward_headers(2), ("X-Meshnet-Dtype", "float32")]
    error = expect_error(
        ctx.send(ctx.forward(headers, float32_body(2))),
        400,
        "duplicate_header",
        header="x-meshnet-dtype",
    )
    if error["hop"] is not None:
        raise CheckFailed(f"a refusal of this server's own input names a hop: {error['hop']!r}")


def _deadline_spent(ctx: Context) -> None:
    headers = [*ctx.forward_headers(2), ("X-Meshnet-Deadline-Ms", "0")]
    expect_error(ctx.send(ctx.forward(headers, float32_body(2))), 504, "deadline_exceeded")


CASES: list[Case] = [
    Case(
        "4.error-body",
        SECTION,
        'an error is JSON {"error": {status, code, message, header, '
        "hop}} with Content-Type application/json",
        _error_body,
    ),
    Case(
        "4.deadline-spent",
        SECTION,
        "X-Meshnet-Deadline-Ms: 0 (already spent) is 504 deadline_exceeded",
        _deadline_spent,
    ),
]
