"""wire-2 §2.6: the order of checks. A request with two faults gets the earlier one's answer.

Each case spoils a valid request twice; the spec's order decides which
refusal every implementation must give, so the same bad request gets the same
answer from any server.
"""

from __future__ import annotations

from ._case import (
    BOTH,
    NODE,
    Case,
    Check,
    Context,
    Roles,
    expect_error,
    float32_body,
    new_session,
    replace_header,
)

SECTION = "2"


def _spoiled(ctx: Context, *changes: tuple[str, str | None], body: bytes | None = None) -> bytes:
    headers = ctx.forward_headers(2)
    for name, value in changes:
        headers = replace_header(headers, name, value)
    return ctx.forward(headers, float32_body(2) if body is None else body)


def _path_before_framing(ctx: Context) -> None:
    headers = [("Transfer-Encoding", "chunked"), ("Content-Length", "5")]
    request = ctx.request("POST", "/no-such-path", headers, b"0\r\n\r\n", content_length=False)
    expect_error(ctx.send(request), 404, "not_found")


def _method_before_framing(ctx: Context) -> None:
    expect_error(
        ctx.send(ctx.request("PUT", "/forward", content_length=False)), 405, "method_not_allowed"
    )


def _framing_before_content_type(ctx: Context) -> None:
    request = _spoiled(ctx, ("Content-Type", None)).replace(b"Content-Length: 32\r\n", b"")
    expect_error(ctx.send(request), 411, "length_required")


def _content_type_before_values(ctx: Context) -> None:
    request = _spoiled(ctx, ("Content-Type", "text/plain"), ("X-Meshnet-Shape", "1,,4"))
    expect_error(ctx.send(request), 415, "unsupported_media_type")


def _duplicate_before_wire(ctx: Context) -> None:
    headers = [
        *replace_header(ctx.forward_headers(2), "X-Meshnet-Wire", "3"),
        ("X-Meshnet-Shape", "1,2,4"),
    ]
    response = ctx.send(ctx.forward(headers, float32_body(2)))
    expect_error(response, 400, "duplicate_header", header="x-meshnet-shape")


def _wire_before_values(ctx: Context) -> None:
    request = _spoiled(ctx, ("X-Meshnet-Wire", "3"), ("X-Meshnet-Shape", "1,,4"))
    expect_error(ctx.send(request), 400, "wire_version_mismatch")


def _shape_before_dtype(ctx: Context) -> None:
    request = _spoiled(ctx, ("X-Meshnet-Shape", "1,0,4"), ("X-Meshnet-Dtype", "float64"))
    expect_error(ctx.send(request), 400, "bad_shape")


def _dtype_before_session(ctx: Context) -> None:
    request = _spoiled(ctx, ("X-Meshnet-Dtype", "float64"), ("X-Meshnet-Session", "S"))
    expect_error(ctx.send(request), 415, "unsupported_dtype")


def _values_before_size(ctx: Context) -> None:
    request = _spoiled(ctx, ("X-Meshnet-Shape", "1,1000000000000,4"), ("X-Meshnet-Position", "01"))
    expect_error(ctx.send(request), 400, "bad_integer", header="x-meshnet-position")


def _size_before_body(ctx: Context) -> None:
    request = _spoiled(ctx, ("X-Meshnet-Shape", "1,1000000000000,4"), body=b"short")
    expect_error(ctx.send(request), 413, "tensor_too_large")


def _sequencing_before_body(ctx: Context) -> None:
    # An index-0 chunk at position 7 of a session this node never saw is
    # refused on its head: the broken zstd body must not be what is reported.
    request = _spoiled(
        ctx,
        ("X-Meshnet-Session", new_session()),
        ("X-Meshnet-Position", "7"),
        ("X-Meshnet-Encoding", "zstd"),
        body=b"not a zstd frame",
    )
    expect_error(ctx.send(request), 409, "session_unknown")


def _case(id: str, description: str, check: Check, roles: Roles = BOTH) -> Case:
    return Case(id, SECTION, description, check, roles)


CASES: list[Case] = [
    _case(
        "2.order.path-before-framing",
        "an unknown path is 404 even with bad framing",
        _path_before_framing,
    ),
    _case(
        "2.order.method-before-framing",
        "a wrong method on /forward is 405, not 411",
        _method_before_framing,
    ),
    _case(
        "2.order.framing-before-content-type",
        "no length and no Content-Type is 411, not 415",
        _framing_before_content_type,
    ),
    _case(
        "2.order.content-type-before-values",
        "a wrong Content-Type and a bad shape is 415",
        _content_type_before_values,
    ),
    _case(
        "2.order.duplicate-before-wire",
        "a duplicate header and a wrong wire version is 400 duplicate_header",
        _duplicate_before_wire,
    ),
    _case(
        "2.order.wire-before-values",
        "a wrong wire version and a bad shape is 400 wire_version_mismatch",
        _wire_before_values,
    ),
    _case(
        "2.order.shape-before-dtype",
        "a bad shape and an unsupported dtype is 400 bad_shape",
        _shape_before_dtype,
    ),
    _case(
        "2.order.dtype-before-session",
        "an unsupported dtype and a bad session is 415",
        _dtype_before_session,
    ),
    _case(
        "2.order.values-before-size",
        "a bad integer and a tensor over the limit is 400",
        _values_before_size,
    ),
    _case(
        "2.order.size-before-body",
        "a tensor over the limit with a short body is 413",
        _size_before_body,
    ),
    _case(
        "2.order.sequencing-before-body",
        "an unknown session at position 7 with a broken zstd body is 409 session_unknown",
        _sequencing_before_body,
        roles=NODE,
    ),
]
