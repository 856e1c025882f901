"""wire-2 §5: what a server sends back (its default policies)."""

from __future__ import annotations

import zstandard

from ._case import Case, Context, expect_tensor, float32_body

SECTION = "5"


def _mirror(ctx: Context) -> None:
    body = zstandard.ZstdCompressor(level=1).compress(float32_body(2))
    response = ctx.send(ctx.forward(ctx.forward_headers(2, encoding="zstd"), body))
    expect_tensor(response, shape="1,2,4", encoding="zstd")
    expect_tensor(ctx.send(ctx.forward(ctx.forward_headers(2), float32_body(2))), shape="1,2,4")


def _keep_dtype(ctx: Context) -> None:
    response = ctx.send(ctx.forward(ctx.forward_headers(2, dtype="bfloat16"), bytes(16)))
    expect_tensor(response, shape="1,2,4", dtype="bfloat16")


CASES: list[Case] = [
    Case(
        "5.mirror",
        SECTION,
        "by default the answer's encoding mirrors the request's "
        "(zstd in, zstd out; identity in, identity out)",
        _mirror,
    ),
    Case("5.keep-dtype", SECTION, "by default the answer keeps the request's dtype", _keep_dtype),
]
