"""A table of bad HTTP inputs and the exact wire-2 §4 answer each one gets.

Every row is fed whole and one byte at a time; both ways must produce one
`ProtocolErrorReceived` with the row's status and code, and `send_error`
must turn it into a JSON body saying the same, with ``Connection: close``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import pytest

from meshnet_proto import (
    NEED_DATA,
    PAUSED,
    ActivationHead,
    ConnectionClosed,
    Limits,
    ProtocolErrorReceived,
    ServerConnection,
    WireHeaders,
    encode_tensor,
)

SESSION = "5b1e0c2a-9f3d-4c1e-8a7b-0123456789ab"
TOKEN = "tok-0123456789-secret"
ARRAY = np.arange(24, dtype=np.float32).reshape(1, 6, 4)
BODY = bytes(encode_tensor(ARRAY))
ZBODY = bytes(encode_tensor(ARRAY, encoding="zstd"))


def wire_pairs(**fields: object) -> list[tuple[bytes, bytes]]:
    fields = {"session": SESSION, "chunk_index": 0, "chunk_total": 1, **fields}
    return WireHeaders.for_array(ARRAY, **fields).to_pairs()


def build(
    *,
    method: bytes = b"POST",
    target: bytes = b"/forward",
    pairs: Sequence[tuple[bytes, bytes]] | None = None,
    drop: Sequence[bytes] = (),
    replace: dict[bytes, bytes] | None = None,
    add: Sequence[tuple[bytes, bytes]] = (),
    length: int | str | None = "auto",
    body: bytes = BODY,
    version: bytes = b"HTTP/1.1",
) -> bytes:
    """A request from parts: wire headers (minus ``drop``, with ``replace``),
    ``add`` appended, then Content-Length (``length="auto"`` = the body's)."""
    replace = {k.lower(): v for k, v in (replace or {}).items()}
    lines = [b"Host: node"]
    for name, value in wire_pairs() if pairs is None else pairs:
        if name.lower() in drop:
            continue
        lines.append(name + b": " + replace.get(name.lower(), value))
    lines += [name + b": " + value for name, value in add]
    if length == "auto":
        lines.append(b"Content-Length: %d" % len(body))
    elif length is not None:
        lines.append(b"Content-Length: %d" % length)
    head = method + b" " + target + b" " + version + b"\r\n" + b"\r\n".join(lines) + b"\r\n\r\n"
    return head + body


def chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)


TE = (b"Transfer-Encoding", b"chunked")
AUTH = (b"Authorization", b"Bearer " + TOKEN.encode())

# (id, request bytes, status, code, connection options)
CASES: list[tuple[str, bytes, int, str, dict]] = [
    # --- framing: request smuggling and lengths (wire-2 §2)
    ("cl_and_te_smuggling", build(add=[TE], body=chunked(BODY)), 400, "bad_framing", {}),
    (
        "te_gzip",
        build(add=[(b"Transfer-Encoding", b"gzip")], length=None),
        400,
        "bad_framing",
        {},
    ),
    (
        "te_gzip_then_chunked",
        build(add=[(b"Transfer-Encoding", b"gzip, chunked")], length=None, body=chunked(BODY)),
        400,
        "bad_framing",
        {},
    ),
    (
        "two_te_headers",
        build(add=[TE, TE], length=None, body=chunked(BODY)),
        400,
        "bad_framing",
        {},
    ),
    (
        "two_different_content_lengths",
        build(add=[(b"Content-Length", b"5")]),
        400,
        "bad_framing",
        {},
    ),
    (
        "content_length_not_a_number",
        build(length=None, add=[(b"Content-Length", b"9x")]),
        400,
        "bad_framing",
        {},
    ),
    ("post_without_any_length", build(length=None, body=b""), 411, "length_required", {}),
    (
        "header_block_too_large",
        build(add=[(b"X-Padding", b"a" * (17 * 1024))]),
        431,
        "header_block_too_large",
        {},
    ),
    # --- HTTP the parser cannot read
    ("garbage_request_line", b"HELLO THERE\r\n\r\n", 400, "malformed_request", {}),
    (
        "header_without_colon",
        build(add=[(b"Broken", b"")]).replace(b"Broken: ", b"Broken"),
        400,
        "malformed_request",
        {},
    ),
    (
        "http11_without_host",
        build(drop=[b"host"]).replace(b"Host: node\r\n", b""),
        400,
        "malformed_request",
        {},
    ),
    (
        "bad_chunk_size",
        build(add=[TE], length=None, body=b"zz\r\n" + BODY + b"\r\n0\r\n\r\n"),
        400,
        "malformed_request",
        {},
    ),
    # h11 reads any "HTTP/d.d"; only 1.1 (and its subset 1.0) is served.
    ("http_2_0_request_line", build(version=b"HTTP/2.0"), 400, "malformed_request", {}),
    ("http_0_9_request_line", build(version=b"HTTP/0.9"), 400, "malformed_request", {}),
    ("http_1_2_request_line", build(version=b"HTTP/1.2"), 400, "malformed_request", {}),
    # --- credentials, path, method (wire-2 §2 order, §7)
    ("no_token", build(), 401, "unauthorized", {"token": TOKEN}),
    (
        "wrong_token",
        build(add=[(b"Authorization", b"Bearer " + TOKEN.encode()[:-1] + b"X")]),
        401,
        "unauthorized",
        {"token": TOKEN},
    ),
    (
        "bad_token_beats_unknown_path",
        build(target=b"/nowhere", add=[(b"Authorization", b"Bearer nope")]),
        401,
        "unauthorized",
        {"token": TOKEN},
    ),
    ("unknown_path", build(target=b"/nowhere"), 404, "not_found", {}),
    ("get_forward", build(method=b"GET", length=None, body=b""), 405, "method_not_allowed", {}),
    (
        "wrong_method_beats_missing_length",
        build(method=b"PUT", length=None, body=b""),
        405,
        "method_not_allowed",
        {},
    ),
    (
        "right_token_then_unknown_path",
        build(target=b"/nowhere", add=[AUTH]),
        404,
        "not_found",
        {"token": TOKEN},
    ),
    # --- content type and wire headers (wire-2 §2: 415 → 400/415 → 413)
    (
        "json_body_wire1",
        build(
            pairs=[(b"Content-Type", b"application/json")],
            body=b'{"shape":[1,6,4],"data":[0]}',
        ),
        415,
        "wire1_gone",
        {},
    ),
    ("missing_content_type", build(drop=[b"content-type"]), 415, "unsupported_media_type", {}),
    (
        "framing_beats_content_type",
        build(pairs=[(b"Content-Type", b"application/json")], add=[TE], body=chunked(b"{}")),
        400,
        "bad_framing",
        {},
    ),
    ("wire_3", build(replace={b"x-meshnet-wire": b"3"}), 400, "wire_version_mismatch", {}),
    ("missing_shape", build(drop=[b"x-meshnet-shape"]), 400, "missing_header", {}),
    (
        "duplicate_shape",
        build(add=[(b"X-Meshnet-Shape", b"1,6,4")]),
        400,
        "duplicate_header",
        {},
    ),
    ("wrong_case_dtype", build(replace={b"x-meshnet-dtype": b"Float32"}), 400, "bad_dtype", {}),
    (
        "unsupported_dtype",
        build(replace={b"x-meshnet-dtype": b"float64"}),
        415,
        "unsupported_dtype",
        {},
    ),
    (
        "unsupported_encoding",
        build(replace={b"x-meshnet-encoding": b"gzip"}),
        415,
        "unsupported_encoding",
        {},
    ),
    (
        "tensor_too_large",
        build(replace={b"x-meshnet-shape": b"1,65536,65536"}, body=b""),
        413,
        "tensor_too_large",
        {},
    ),
    # --- body (wire-2 §2: over the bound 413, otherwise 400)
    ("identity_body_shorter_than_promised", build(body=BODY[:-4]), 400, "body_size_mismatch", {}),
    ("identity_body_longer_than_promised", build(body=BODY + b"xxxx"), 413, "body_too_large", {}),
    (
        "zstd_content_length_over_bound",
        build(replace={b"x-meshnet-encoding": b"zstd"}, body=b"\x00" * (len(BODY) * 2)),
        413,
        "body_too_large",
        {},
    ),
    (
        "chunked_body_over_bound",
        build(add=[TE], length=None, body=chunked(BODY + b"x" * 64)),
        413,
        "body_too_large",
        {},
    ),
    (
        "chunked_body_short",
        build(add=[TE], length=None, body=chunked(BODY[:-1])),
        400,
        "body_size_mismatch",
        {},
    ),
    (
        "zstd_garbage",
        build(replace={b"x-meshnet-encoding": b"zstd"}, body=b"not a zstd frame"),
        400,
        "bad_zstd_frame",
        {},
    ),
    (
        "zstd_trailing_bytes",
        build(replace={b"x-meshnet-encoding": b"zstd"}, body=ZBODY + b"\x00"),
        400,
        "bad_zstd_frame",
        {},
    ),
    (
        "endpoint_body_too_large",
        build(method=b"DELETE", target=b"/sessions/" + SESSION.encode(), body=b"x" * 70_000),
        413,
        "body_too_large",
        {},
    ),
    (
        "endpoint_chunked_body_too_large",
        build(
            method=b"DELETE",
            target=b"/sessions/x",
            add=[TE],
            length=None,
            body=chunked(b"x" * 70_000),
        ),
        413,
        "body_too_large",
        {},
    ),
]


def run(conn: ServerConnection, data: bytes, step: int | None) -> list[object]:
    """Feed ``data``, reading every activation body (as a driver that does
    not reject early would), until the first error or the end."""
    events: list[object] = []
    step = step or len(data)
    for start in range(0, len(data), step):
        conn.receive_data(data[start : start + step])
        while True:
            event = conn.next_event()
            if event is NEED_DATA or event is PAUSED:
                break
            events.append(event)
            if isinstance(event, (ProtocolErrorReceived, ConnectionClosed)):
                return events
    return events


@pytest.mark.parametrize(
    ("request_bytes", "status", "code", "options"),
    [
        pytest.param(data, status, code, options, id=name)
        for name, data, status, code, options in CASES
    ],
)
@pytest.mark.parametrize("step", [None, 1], ids=["whole", "bytewise"])
def test_bad_input_gets_its_exact_status_and_code(
    request_bytes: bytes, status: int, code: str, options: dict, step: int | None
) -> None:
    conn = ServerConnection(**options)
    events = run(conn, request_bytes, step)
    errors = [event for event in events if isinstance(event, ProtocolErrorReceived)]
    assert len(errors) == 1, events
    assert not [
        event for event in events if not isinstance(event, (ActivationHead, ProtocolErrorReceived))
    ]
    error = errors[0].error
    assert (error.status, error.code) == (status, code)

    out = b"".join(bytes(piece) for piece in conn.send_error(error))
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status)
    assert b"Content-Type: application/json" in head
    assert b"Connection: close" in head
    document = json.loads(body)
    assert document["error"]["status"] == status
    assert document["error"]["code"] == code
    assert set(document["error"]) == {"status", "code", "message", "header", "hop"}
    assert TOKEN.encode() not in out
    assert conn.should_close
    assert conn.next_event() == ConnectionClosed()


def test_the_table_is_big_enough() -> None:
    assert len(CASES) >= 15
    assert len({name for name, *_ in CASES}) == len(CASES)


def test_header_limit_follows_limits() -> None:
    small = Limits(max_header_bytes=2048)
    request = build(add=[(b"X-Padding", b"a" * 3000)])
    events = run(ServerConnection(limits=small), request, None)
    assert events[-1].error.code == "header_block_too_large"
    events = run(ServerConnection(), request, None)
    assert [type(event).__name__ for event in events] == ["ActivationHead", "ActivationReceived"]
