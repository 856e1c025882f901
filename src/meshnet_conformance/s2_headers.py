"""wire-2 §2: a valid message is served, and every header's grammar is enforced."""

from __future__ import annotations

from collections.abc import Callable

from ._case import (
    BOTH,
    NODE,
    Case,
    Context,
    expect_error,
    expect_tensor,
    float32_body,
    replace_header,
    single,
)
from ._wire import Response

SECTION = "2"


def _with(name: str, value: str | None, *, tokens: int = 2) -> Callable[[Context], bytes]:
    """A valid forward request with header ``name`` set to ``value`` (None: removed)."""

    def request(ctx: Context) -> bytes:
        headers = replace_header(ctx.forward_headers(tokens), name, value)
        return ctx.forward(headers, float32_body(tokens))

    return request


def _error(status: int, code: str, header: str | None) -> Callable[[Response], object]:
    return lambda response: expect_error(response, status, code, header=header)


def _refused(
    id: str,
    description: str,
    name: str,
    value: str | None,
    status: int,
    code: str,
    *,
    roles: frozenset[str] = BOTH,
) -> Case:
    return single(
        id,
        SECTION,
        description,
        _with(name, value),
        _error(status, code, name.lower()),
        roles=roles,
    )


def _valid(ctx: Context) -> None:
    response = ctx.send(ctx.forward(ctx.forward_headers(2), float32_body(2)))
    expect_tensor(response, shape=f"1,2,{4}")


def _unknown_meshnet_header(ctx: Context) -> None:
    headers = [*ctx.forward_headers(2), ("X-Meshnet-Future-Extension", "anything at all")]
    expect_tensor(ctx.send(ctx.forward(headers, float32_body(2))), shape="1,2,4")


def _mixed_case_names(ctx: Context) -> None:
    headers = [(name.upper(), value) for name, value in ctx.forward_headers(2)]
    expect_tensor(ctx.send(ctx.forward(headers, float32_body(2))), shape="1,2,4")


def _duplicate(ctx: Context) -> None:
    headers = [*ctx.forward_headers(2), ("X-Meshnet-Dtype", "float32")]
    expect_error(
        ctx.send(ctx.forward(headers, float32_body(2))),
        400,
        "duplicate_header",
        header="x-meshnet-dtype",
    )


def _stage_duplicate(ctx: Context) -> None:
    stage = ("X-Meshnet-Stage", "meshnet-conformance/0")
    headers = [*ctx.forward_headers(2), stage, stage]
    expect_error(
        ctx.send(ctx.forward(headers, float32_body(2))),
        400,
        "duplicate_header",
        header="x-meshnet-stage",
    )


def _too_large(ctx: Context) -> None:
    headers = replace_header(ctx.forward_headers(2), "X-Meshnet-Shape", "1,1000000000000,4")
    expect_error(
        ctx.send(ctx.forward(headers, b"")),
        413,
        "tensor_too_large",
        header="x-meshnet-shape",
    )


def _gateway_whole_sequence(ctx: Context) -> None:
    headers = ctx.forward_headers(2, index=1, total=2)
    expect_error(
        ctx.send(ctx.forward(headers, float32_body(2))),
        400,
        "bad_chunk_index",
        header="x-meshnet-chunk-total",
    )


SHAPE = "X-Meshnet-Shape"
DTYPE = "X-Meshnet-Dtype"
INDEX = "X-Meshnet-Chunk-Index"

CASES: list[Case] = [
    Case(
        "2.valid",
        SECTION,
        "a valid float32 identity message is answered 200 with a "
        "well-formed wire-2 tensor (Wire 2, Shape, Dtype, Position, Content-Length)",
        _valid,
    ),
    Case(
        "2.unknown-header",
        SECTION,
        "an unknown X-Meshnet-* header is ignored (forward compatibility)",
        _unknown_meshnet_header,
    ),
    Case("2.name-case", SECTION, "header names are case-insensitive (HTTP)", _mixed_case_names),
    Case(
        "2.duplicate",
        SECTION,
        "a known X-Meshnet-* header given twice is 400 duplicate_header",
        _duplicate,
    ),
    _refused(
        "2.wire-1",
        "X-Meshnet-Wire other than 2 is 400 wire_version_mismatch",
        "X-Meshnet-Wire",
        "1",
        400,
        "wire_version_mismatch",
    ),
    _refused(
        "2.shape-missing",
        "a missing X-Meshnet-Shape is 400 missing_header",
        SHAPE,
        None,
        400,
        "missing_header",
    ),
    _refused(
        "2.shape-space",
        "a shape with a space ('1, 2,4') is 400 bad_shape",
        SHAPE,
        "1, 2,4",
        400,
        "bad_shape",
    ),
    _refused("2.shape-zero", "a dimension 0 is 400 bad_shape", SHAPE, "1,0,4", 400, "bad_shape"),
    _refused(
        "2.shape-leading-zero",
        "a dimension with a leading zero is 400 bad_shape",
        SHAPE,
        "1,02,4",
        400,
        "bad_shape",
    ),
    _refused(
        "2.shape-empty-dim",
        "an empty dimension ('1,,4') is 400 bad_shape",
        SHAPE,
        "1,,4",
        400,
        "bad_shape",
    ),
    _refused(
        "2.shape-rank-9",
        "more than 8 dimensions is 400 bad_shape",
        SHAPE,
        "1,2,1,1,1,1,1,1,4",
        400,
        "bad_shape",
    ),
    _refused(
        "2.shape-sign",
        "a signed dimension ('+1') is 400 bad_shape",
        SHAPE,
        "+1,2,4",
        400,
        "bad_shape",
    ),
    _refused(
        "2.dtype-missing",
        "a missing X-Meshnet-Dtype is 400 missing_header",
        DTYPE,
        None,
        400,
        "missing_header",
    ),
    _refused(
        "2.dtype-case",
        "dtype tokens are case-sensitive: 'Float32' is 400 bad_dtype",
        DTYPE,
        "Float32",
        400,
        "bad_dtype",
    ),
    _refused(
        "2.dtype-junk",
        "a dtype that is not a token ('f32!') is 400 bad_dtype",
        DTYPE,
        "f32!",
        400,
        "bad_dtype",
    ),
    _refused(
        "2.dtype-unsupported",
        "a well-formed unsupported dtype ('float64') is 415 unsupported_dtype",
        DTYPE,
        "float64",
        415,
        "unsupported_dtype",
    ),
    _refused(
        "2.encoding-case",
        "encoding tokens are case-sensitive: 'ZSTD' is 400 bad_encoding",
        "X-Meshnet-Encoding",
        "ZSTD",
        400,
        "bad_encoding",
    ),
    _refused(
        "2.encoding-unsupported",
        "a well-formed unsupported encoding ('gzip') is 415 unsupported_encoding",
        "X-Meshnet-Encoding",
        "gzip",
        415,
        "unsupported_encoding",
    ),
    _refused(
        "2.session-upper",
        "a session UUID in uppercase is 400 bad_session",
        "X-Meshnet-Session",
        "5B1E3C2A-0000-4000-8000-00000000000A",
        400,
        "bad_session",
    ),
    _refused(
        "2.session-braces",
        "a session UUID in braces is 400 bad_session",
        "X-Meshnet-Session",
        "{5b1e3c2a-0000-4000-8000-00000000000a}",
        400,
        "bad_session",
    ),
    _refused(
        "2.session-missing",
        "to a node, a missing X-Meshnet-Session is 400 missing_header",
        "X-Meshnet-Session",
        None,
        400,
        "missing_header",
        roles=NODE,
    ),
    _refused(
        "2.index-missing",
        "to a node, a missing X-Meshnet-Chunk-Index is 400 missing_header",
        INDEX,
        None,
        400,
        "missing_header",
        roles=NODE,
    ),
    _refused(
        "2.integer-leading-zero",
        "an integer with a leading zero ('00') is 400 bad_integer",
        INDEX,
        "00",
        400,
        "bad_integer",
        roles=NODE,
    ),
    _refused(
        "2.integer-unicode-digit",
        "an integer in non-ASCII digits (U+0664) is 400 bad_integer",
        INDEX,
        "\u0664",
        400,
        "bad_integer",
        roles=NODE,
    ),
    _refused(
        "2.integer-20-digits",
        "an integer of 20 digits is 400 bad_integer",
        "X-Meshnet-Position",
        "1" * 20,
        400,
        "bad_integer",
    ),
    _refused(
        "2.integer-sign",
        "a signed integer ('-0') is 400 bad_integer",
        "X-Meshnet-Position",
        "-0",
        400,
        "bad_integer",
    ),
    _refused(
        "2.index-not-below-total",
        "chunk index >= chunk total is 400 bad_chunk_index",
        INDEX,
        "1",
        400,
        "bad_chunk_index",
        roles=NODE,
    ),
    _refused(
        "2.total-zero",
        "chunk total 0 is 400 bad_chunk_index",
        "X-Meshnet-Chunk-Total",
        "0",
        400,
        "bad_chunk_index",
        roles=NODE,
    ),
    _refused(
        "2.stage.bad-grammar",
        "an X-Meshnet-Stage that is not '<model-id>/<first "
        "layer>' (uppercase, a leading zero: 'Stub/01') is 400 bad_stage",
        "X-Meshnet-Stage",
        "Stub/01",
        400,
        "bad_stage",
    ),
    _refused(
        "2.prefix.bad-key",
        "an X-Meshnet-Prefix that is not a block key (32 lowercase "
        "hex digits) is 400 bad_prefix (wire-2 §3.10)",
        "X-Meshnet-Prefix",
        "XYZ",
        400,
        "bad_prefix",
    ),
    _refused(
        "2.prefix-blocks.count",
        "X-Meshnet-Prefix-Blocks naming a block on a 2-token "
        "chunk at position 0 (no block ends in it) is 400 bad_prefix (wire-2 §3.10)",
        "X-Meshnet-Prefix-Blocks",
        "0" * 32,
        400,
        "bad_prefix",
    ),
    Case(
        "2.stage.duplicate",
        SECTION,
        "X-Meshnet-Stage given twice (equal values) is 400 duplicate_header",
        _stage_duplicate,
    ),
    Case(
        "2.gateway-one-sequence",
        SECTION,
        "a gateway takes one whole sequence: total other than 1 is 400 bad_chunk_index",
        _gateway_whole_sequence,
        roles=frozenset({"gateway"}),
    ),
    Case(
        "2.tensor-too-large",
        SECTION,
        "a shape over the tensor limit is 413 tensor_too_large before any body byte is read",
        _too_large,
    ),
    _refused(
        "2.content-type-missing",
        "a missing Content-Type is 415 unsupported_media_type",
        "Content-Type",
        None,
        415,
        "unsupported_media_type",
    ),
    _refused(
        "2.content-type-json",
        "Content-Type: application/json is 415 wire1_gone",
        "Content-Type",
        "application/json",
        415,
        "wire1_gone",
    ),
    _refused(
        "2.content-type-params",
        "a media type with parameters is 415 unsupported_media_type",
        "Content-Type",
        "application/octet-stream; x=1",
        415,
        "unsupported_media_type",
    ),
]
