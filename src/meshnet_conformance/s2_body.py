"""wire-2 §2: HTTP framing and bodies, including bounded zstd decompression."""

from __future__ import annotations

import zstandard

from ._case import (
    Case,
    Context,
    expect_error,
    expect_status,
    expect_tensor,
    float32_body,
    replace_header,
)
from ._wire import CheckFailed, Response

SECTION = "2"

# The bomb: 256 MiB of zeros in one frame of about 8 KiB that does not
# declare its content size, sent as a 1 MiB tensor. A server that trusts the
# frame, or bounds the output by anything but the promised size + 1,
# allocates the lot.
BOMB_TOKENS = 65536  # 1 x 65536 x 4 float32 = 1 MiB promised
BOMB_BYTES = 256 * 1024 * 1024


def _bomb() -> bytes:
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    zeros = bytes(1024 * 1024)
    pieces = [compressor.compress(zeros) for _ in range(BOMB_BYTES // len(zeros))]
    return b"".join(pieces) + compressor.flush()


def _zstd(data: bytes, *, with_size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_content_size=with_size).compress(data)


def _post_zstd(ctx: Context, body: bytes, tokens: int = 2) -> Response:
    return ctx.send(ctx.forward(ctx.forward_headers(tokens, encoding="zstd"), body))


def _zstd_valid(ctx: Context) -> None:
    response = _post_zstd(ctx, _zstd(float32_body(2)))
    if response.status != 200:
        raise CheckFailed(f"expected 200, got {response.summary()}")
    encoding = response.header("x-meshnet-encoding") or "identity"
    body = response.body
    if encoding == "zstd":
        body = zstandard.ZstdDecompressor().decompress(body, max_output_size=64)
    if len(body) != 32:
        raise CheckFailed(f"the answer decodes to {len(body)} bytes, not 1x2x4 float32 (32)")


def _bfloat16_valid(ctx: Context) -> None:
    headers = ctx.forward_headers(2, dtype="bfloat16")
    response = ctx.send(ctx.forward(headers, bytes(range(16))))
    expect_tensor(response, shape="1,2,4", dtype="bfloat16")


def _zstd_bomb(ctx: Context) -> None:
    expect_error(_post_zstd(ctx, _bomb(), BOMB_TOKENS), 400, "body_size_mismatch", header=None)


def _zstd_declares_more(ctx: Context) -> None:
    frame = _zstd(bytes(2 * 4 * BOMB_TOKENS * 4))  # declares 2 MiB
    expect_error(_post_zstd(ctx, frame, BOMB_TOKENS), 400, "body_size_mismatch", header=None)


def _zstd_short(ctx: Context) -> None:
    expect_error(
        _post_zstd(ctx, _zstd(bytes(16), with_size=False)), 400, "body_size_mismatch", header=None
    )


def _zstd_truncated(ctx: Context) -> None:
    frame = _zstd(float32_body(2))
    expect_error(_post_zstd(ctx, frame[:-3]), 400, "bad_zstd_frame", header=None)


def _zstd_trailing(ctx: Context) -> None:
    frame = _zstd(float32_body(2))
    expect_error(_post_zstd(ctx, frame + b"\x00"), 400, "bad_zstd_frame", header=None)


def _zstd_not_a_frame(ctx: Context) -> None:
    expect_error(_post_zstd(ctx, b"this is not zstd"), 400, "bad_zstd_frame", header=None)


def _identity_short(ctx: Context) -> None:
    response = ctx.send(ctx.forward(ctx.forward_headers(2), float32_body(2)[:8]))
    expect_error(response, 400, "body_size_mismatch")


def _identity_long(ctx: Context) -> None:
    response = ctx.send(ctx.forward(ctx.forward_headers(2), float32_body(2) + bytes(32)))
    expect_error(response, 413, "body_too_large")


def _chunked(body: bytes, pieces: int = 3) -> bytes:
    step = max(1, len(body) // pieces)
    out = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + step]), body[i : i + step])
        for i in range(0, len(body), step)
    )
    return out + b"0\r\n\r\n"


def _chunked_request(ctx: Context, body: bytes) -> bytes:
    headers = [*ctx.forward_headers(2), ("Transfer-Encoding", "chunked")]
    return ctx.forward(headers, _chunked(body), content_length=False)


def _chunked_valid(ctx: Context) -> None:
    expect_tensor(ctx.send(_chunked_request(ctx, float32_body(2))), shape="1,2,4")


def _chunked_too_long(ctx: Context) -> None:
    response = ctx.send(_chunked_request(ctx, float32_body(2) + bytes(4096)))
    expect_error(response, 413, "body_too_large")


def _cl_and_te(ctx: Context) -> None:
    headers = [*ctx.forward_headers(2), ("Transfer-Encoding", "chunked")]
    response = ctx.send(
        ctx.forward(
            headers,
            _chunked(float32_body(2)),
            content_length=False,
            extra=[("Content-Length", "48")],
        )
    )
    expect_error(response, 400, "bad_framing")


def _te_gzip(ctx: Context) -> None:
    headers = [*ctx.forward_headers(2), ("Transfer-Encoding", "gzip, chunked")]
    response = ctx.send(ctx.forward(headers, _chunked(float32_body(2)), content_length=False))
    expect_error(response, 400, "bad_framing")


def _no_length(ctx: Context) -> None:
    response = ctx.send(ctx.forward(ctx.forward_headers(2), b"", content_length=False))
    expect_error(response, 411, "length_required")


def _expect_continue(ctx: Context) -> None:
    headers = [*ctx.forward_headers(2), ("Expect", "100-continue")]
    request = ctx.forward(headers, b"", content_length=False, extra=[("Content-Length", "32")])
    with ctx.connect() as conn:
        conn.send(request)
        interim = conn.read_response(stop_at_interim=True)
        expect_status(interim, 100)
        conn.send(float32_body(2))
        expect_tensor(conn.read_response(), shape="1,2,4")


def _early_error_closes(ctx: Context) -> None:
    headers = replace_header(ctx.forward_headers(2), "X-Meshnet-Dtype", "Float32")
    request = ctx.forward(
        [*headers, ("Expect", "100-continue")],
        b"",
        content_length=False,
        extra=[("Content-Length", "32")],
    )
    with ctx.connect() as conn:
        conn.send(request)  # the body is never sent: the answer must not wait for it
        response = conn.read_response(stop_at_interim=True)
    if response.interim:
        raise CheckFailed("100 Continue sent for a head that must be refused")
    expect_error(response, 400, "bad_dtype")
    if "close" not in (response.header("connection") or "").lower():
        raise CheckFailed("an answer sent before the body was read lacks Connection: close")


def _http_version(ctx: Context) -> None:
    request = ctx.forward(ctx.forward_headers(2), float32_body(2)).replace(
        b"HTTP/1.1", b"HTTP/2.0", 1
    )
    expect_error(ctx.send(request), 400, "malformed_request")


def _garbage(ctx: Context) -> None:
    # A TLS ClientHello's first bytes, as an http:// server gets when a client
    # speaks https to it: 400, never a 500 or a dropped connection.
    expect_error(
        ctx.send(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n"), 400, "malformed_request"
    )


CASES: list[Case] = [
    Case(
        "2.bfloat16", SECTION, "a bfloat16 message is served (200, dtype bfloat16)", _bfloat16_valid
    ),
    Case(
        "2.zstd",
        SECTION,
        "a zstd body (one frame of exactly the tensor's bytes) is served",
        _zstd_valid,
    ),
    Case(
        "2.zstd-bomb",
        SECTION,
        "a zstd frame of 8 KiB inflating to 256 MiB, promised 1 MiB, "
        "is 400 body_size_mismatch (output bounded by the promise + 1)",
        _zstd_bomb,
    ),
    Case(
        "2.zstd-declared-size",
        SECTION,
        "a zstd frame declaring a content size other than the promise is 400 body_size_mismatch",
        _zstd_declares_more,
    ),
    Case(
        "2.zstd-short",
        SECTION,
        "a zstd frame inflating to less than promised is 400 body_size_mismatch",
        _zstd_short,
    ),
    Case(
        "2.zstd-truncated", SECTION, "a truncated zstd frame is 400 bad_zstd_frame", _zstd_truncated
    ),
    Case(
        "2.zstd-trailing",
        SECTION,
        "bytes after the zstd frame are 400 bad_zstd_frame",
        _zstd_trailing,
    ),
    Case(
        "2.zstd-not-a-frame",
        SECTION,
        "a body that is not a zstd frame is 400 bad_zstd_frame",
        _zstd_not_a_frame,
    ),
    Case(
        "2.identity-short",
        SECTION,
        "an identity body shorter than the tensor is 400 body_size_mismatch",
        _identity_short,
    ),
    Case(
        "2.identity-long",
        SECTION,
        "an identity body longer than the tensor is 413 body_too_large",
        _identity_long,
    ),
    Case("2.chunked", SECTION, "Transfer-Encoding: chunked bodies are accepted", _chunked_valid),
    Case(
        "2.chunked-too-long",
        SECTION,
        "a chunked body past its bound is 413 body_too_large",
        _chunked_too_long,
    ),
    Case(
        "2.framing-cl-te",
        SECTION,
        "Content-Length with Transfer-Encoding is 400 bad_framing (request smuggling)",
        _cl_and_te,
    ),
    Case(
        "2.framing-te-gzip",
        SECTION,
        "a transfer coding other than chunked is 400 bad_framing",
        _te_gzip,
    ),
    Case(
        "2.length-required",
        SECTION,
        "a POST with neither Content-Length nor Transfer-Encoding is 411 length_required",
        _no_length,
    ),
    Case(
        "2.expect-continue",
        SECTION,
        "Expect: 100-continue is answered 100, then the response",
        _expect_continue,
    ),
    Case(
        "2.early-error-closes",
        SECTION,
        "a refusal sent before the body was read comes "
        "without 100 Continue and with Connection: close",
        _early_error_closes,
    ),
    Case(
        "2.http-version",
        SECTION,
        "a request line other than HTTP/1.1 or HTTP/1.0 is 400 malformed_request",
        _http_version,
    ),
    Case("2.not-http", SECTION, "bytes that are not HTTP are 400 malformed_request", _garbage),
]
