"""One table of bad wire-2 inputs: each gets exactly its wire-2 §2/§4 status and code.

Header rows go through ``parse_wire_headers`` (a node's input unless marked
``gateway``); body rows go through ``decode_tensor`` with the headers of a
1x4x8 float32 tensor (128 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import zstandard

from meshnet_proto import Limits, ProtocolError, WireHeaders
from meshnet_proto._codec import decode_tensor
from meshnet_proto._headers import parse_wire_headers

SESSION = "5b1e7c2a-0d4f-4e8b-9a1c-3f6e2d7b8c90"
BASE: dict[str, str] = {
    "content-type": "application/octet-stream",
    "x-meshnet-wire": "2",
    "x-meshnet-shape": "1,4,8",
    "x-meshnet-dtype": "float32",
    "x-meshnet-session": SESSION,
    "x-meshnet-chunk-index": "0",
    "x-meshnet-chunk-total": "1",
}
DROP = None


@dataclass(frozen=True)
class HeaderCase:
    changes: dict[str, str | None]
    status: int
    code: str
    header: str | None
    extra: list[tuple[str, str]] = field(default_factory=list)
    gateway: bool = False


def build(case: HeaderCase) -> list[tuple[bytes, bytes]]:
    merged = {**BASE, **case.changes}
    given = [(name, value) for name, value in merged.items() if value is not None]
    return [(name.encode(), value.encode()) for name, value in [*given, *case.extra]]


S, D, IX, TT = (
    "x-meshnet-shape",
    "x-meshnet-dtype",
    "x-meshnet-chunk-index",
    "x-meshnet-chunk-total",
)
CT, SE, EN = "content-type", "x-meshnet-session", "x-meshnet-encoding"

HEADER_CASES: dict[str, HeaderCase] = {
    # content type: 415, first of the header checks
    "content-type missing": HeaderCase({CT: DROP}, 415, "unsupported_media_type", CT),
    "content-type text/plain": HeaderCase({CT: "text/plain"}, 415, "unsupported_media_type", CT),
    "content-type with parameter": HeaderCase(
        {CT: "application/octet-stream; q=1"}, 415, "unsupported_media_type", CT
    ),
    "wire 1 json": HeaderCase({CT: "application/json"}, 415, "wire1_gone", CT),
    "wire 1 json charset": HeaderCase(
        {CT: "Application/JSON; charset=utf-8"}, 415, "wire1_gone", CT
    ),
    "content-type twice": HeaderCase(
        {}, 400, "duplicate_header", CT, extra=[(CT, "application/octet-stream")]
    ),
    "content-type beats bad dtype": HeaderCase(
        {CT: "text/plain", D: "Float32"}, 415, "unsupported_media_type", CT
    ),
    # duplicates
    "shape twice": HeaderCase({}, 400, "duplicate_header", S, extra=[(S, "1,4,8")]),
    "dtype twice, differently": HeaderCase(
        {}, 400, "duplicate_header", D, extra=[("X-Meshnet-Dtype", "int32")]
    ),
    "position twice": HeaderCase(
        {"x-meshnet-position": "0"},
        400,
        "duplicate_header",
        "x-meshnet-position",
        extra=[("x-meshnet-position", "0")],
    ),
    "duplicate beats wire version": HeaderCase(
        {"x-meshnet-wire": "1"}, 400, "duplicate_header", S, extra=[(S, "1")]
    ),
    # wire version
    "wire 1": HeaderCase({"x-meshnet-wire": "1"}, 400, "wire_version_mismatch", "x-meshnet-wire"),
    "wire 02": HeaderCase({"x-meshnet-wire": "02"}, 400, "wire_version_mismatch", "x-meshnet-wire"),
    "wire empty": HeaderCase(
        {"x-meshnet-wire": ""}, 400, "wire_version_mismatch", "x-meshnet-wire"
    ),
    # shape
    "shape missing": HeaderCase({S: DROP}, 400, "missing_header", S),
    "shape empty": HeaderCase({S: ""}, 400, "bad_shape", S),
    "shape double comma": HeaderCase({S: "1,,8"}, 400, "bad_shape", S),
    "shape trailing comma": HeaderCase({S: "1,4,"}, 400, "bad_shape", S),
    "shape zero dim": HeaderCase({S: "1,0,8"}, 400, "bad_shape", S),
    "shape nine dims": HeaderCase({S: ",".join(["1"] * 9)}, 400, "bad_shape", S),
    "shape leading zero": HeaderCase({S: "1,04,8"}, 400, "bad_shape", S),
    "shape space": HeaderCase({S: "1, 4,8"}, 400, "bad_shape", S),
    "shape arabic digit": HeaderCase({S: "1,٤,8"}, 400, "bad_shape", S),
    "shape negative": HeaderCase({S: "-1,4,8"}, 400, "bad_shape", S),
    "shape 20 digits": HeaderCase({S: "1," + "1" * 20}, 400, "bad_shape", S),
    "shape semicolons": HeaderCase({S: "1;4;8"}, 400, "bad_shape", S),
    # dtype
    "dtype missing": HeaderCase({D: DROP}, 400, "missing_header", D),
    "dtype wrong case": HeaderCase({D: "Float32"}, 400, "bad_dtype", D),
    "dtype junk": HeaderCase({D: "f32!"}, 400, "bad_dtype", D),
    "dtype empty": HeaderCase({D: ""}, 400, "bad_dtype", D),
    "dtype too long": HeaderCase({D: "f" * 33}, 400, "bad_dtype", D),
    "dtype float64": HeaderCase({D: "float64"}, 415, "unsupported_dtype", D),
    "dtype int8": HeaderCase({D: "int8"}, 415, "unsupported_dtype", D),
    # encoding
    "encoding gzip": HeaderCase({EN: "gzip"}, 415, "unsupported_encoding", EN),
    "encoding br": HeaderCase({EN: "br"}, 415, "unsupported_encoding", EN),
    "encoding wrong case": HeaderCase({EN: "ZSTD"}, 400, "bad_encoding", EN),
    "encoding list": HeaderCase({EN: "zstd, identity"}, 400, "bad_encoding", EN),
    # session
    "session missing": HeaderCase({SE: DROP}, 400, "missing_header", SE),
    "session uppercase": HeaderCase({SE: SESSION.upper()}, 400, "bad_session", SE),
    "session braces": HeaderCase({SE: "{" + SESSION + "}"}, 400, "bad_session", SE),
    "session urn": HeaderCase({SE: "urn:uuid:" + SESSION}, 400, "bad_session", SE),
    "session no hyphens": HeaderCase({SE: SESSION.replace("-", "")}, 400, "bad_session", SE),
    "session newline": HeaderCase({SE: SESSION + "\n"}, 400, "bad_session", SE),
    # chunk index / total
    "index missing": HeaderCase({IX: DROP}, 400, "missing_header", IX),
    "total missing": HeaderCase({TT: DROP}, 400, "missing_header", TT),
    "index plus sign": HeaderCase({IX: "+0"}, 400, "bad_integer", IX),
    "index underscore": HeaderCase({TT: "1_0"}, 400, "bad_integer", TT),
    "index fullwidth": HeaderCase({IX: "\uff10"}, 400, "bad_integer", IX),
    "index 20 digits": HeaderCase({IX: "1" * 20}, 400, "bad_integer", IX),
    "index equals total": HeaderCase({IX: "1", TT: "1"}, 400, "bad_chunk_index", IX),
    "total zero": HeaderCase({TT: "0"}, 400, "bad_chunk_index", TT),
    "total over limit": HeaderCase({TT: "65537"}, 400, "bad_chunk_index", TT),
    "gateway index 1": HeaderCase({IX: "1", TT: "2"}, 400, "bad_chunk_index", TT, gateway=True),
    "gateway index 1 alone": HeaderCase(
        {IX: "1", TT: DROP}, 400, "bad_chunk_index", IX, gateway=True
    ),
    "gateway bad session": HeaderCase({SE: "nope"}, 400, "bad_session", SE, gateway=True),
    # optional integers
    "position space": HeaderCase(
        {"x-meshnet-position": " 1"}, 400, "bad_integer", "x-meshnet-position"
    ),
    "deadline float": HeaderCase(
        {"x-meshnet-deadline-ms": "1e3"}, 400, "bad_integer", "x-meshnet-deadline-ms"
    ),
    "deadline negative": HeaderCase(
        {"x-meshnet-deadline-ms": "-5"}, 400, "bad_integer", "x-meshnet-deadline-ms"
    ),
    # size: 413 after every value check
    "tensor too large": HeaderCase({S: "65536,65536,1024"}, 413, "tensor_too_large", S),
    "bad dtype beats too large": HeaderCase(
        {S: "65536,65536,1024", D: "Float32"}, 400, "bad_dtype", D
    ),
    "bad session beats too large": HeaderCase(
        {S: "65536,65536,1024", SE: "x"}, 400, "bad_session", SE
    ),
}


@pytest.mark.parametrize("case", HEADER_CASES.values(), ids=HEADER_CASES.keys())
def test_bad_headers(case: HeaderCase) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_wire_headers(build(case), require_sequencing=not case.gateway)
    error = info.value
    assert (error.status, error.code, error.header) == (case.status, case.code, case.header)
    assert error.message


def test_the_base_is_valid() -> None:
    assert parse_wire_headers(build(HeaderCase({}, 0, "", None))).nbytes == 128


# ------------------------------------------------------------------- bodies

TENSOR = np.arange(32, dtype=np.float32).reshape(1, 4, 8)
RAW = TENSOR.tobytes()
FRAME = zstandard.ZstdCompressor(level=1).compress(RAW)
SHORT = zstandard.ZstdCompressor(level=1).compress(RAW[:-4])
LONG = zstandard.ZstdCompressor(level=1).compress(RAW + b"\0\0\0\0")
UNSIZED_LONG = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(RAW + b"\0")


def _lying_frame(declared: int) -> bytes:
    # A raw-block frame whose 4-byte content size field says `declared`.
    block = ((len(RAW) << 3) | 1).to_bytes(3, "little") + RAW
    return b"\x28\xb5\x2f\xfd" + bytes([0x80, 0x50]) + declared.to_bytes(4, "little") + block


BODY_CASES: dict[str, tuple[str, bytes, int, str]] = {
    "identity short": ("identity", RAW[:-1], 400, "body_size_mismatch"),
    "identity long": ("identity", RAW + b"\0", 400, "body_size_mismatch"),
    "identity empty": ("identity", b"", 400, "body_size_mismatch"),
    "zstd empty": ("zstd", b"", 400, "bad_zstd_frame"),
    "zstd not a frame": ("zstd", RAW, 400, "bad_zstd_frame"),
    "zstd truncated": ("zstd", FRAME[:-3], 400, "bad_zstd_frame"),
    "zstd header only": ("zstd", FRAME[:6], 400, "bad_zstd_frame"),
    "zstd trailing garbage": ("zstd", FRAME + b"garbage", 400, "bad_zstd_frame"),
    "zstd second frame": ("zstd", FRAME + FRAME, 400, "bad_zstd_frame"),
    "zstd decompresses short": ("zstd", SHORT, 400, "body_size_mismatch"),
    "zstd declares more": ("zstd", LONG, 400, "body_size_mismatch"),
    "zstd unsized, decompresses long": ("zstd", UNSIZED_LONG, 400, "body_size_mismatch"),
    "zstd declares 4 GiB": ("zstd", _lying_frame(2**32 - 1), 400, "body_size_mismatch"),
    "zstd declares too little": ("zstd", _lying_frame(64), 400, "body_size_mismatch"),
    "zstd body over bound": ("zstd", FRAME + b"\0" * 4096, 413, "body_too_large"),
}


@pytest.mark.parametrize(
    ("encoding", "body", "status", "code"), BODY_CASES.values(), ids=BODY_CASES.keys()
)
def test_bad_bodies(encoding: str, body: bytes, status: int, code: str) -> None:
    headers = WireHeaders(shape=(1, 4, 8), dtype="float32", encoding=encoding)
    with pytest.raises(ProtocolError) as info:
        decode_tensor(headers, body, limits=Limits())
    assert (info.value.status, info.value.code) == (status, code)
    assert info.value.header is None


def test_the_good_bodies_decode() -> None:
    identity = WireHeaders(shape=(1, 4, 8), dtype="float32")
    assert decode_tensor(identity, RAW).tobytes() == RAW
    assert decode_tensor(identity.replace(encoding="zstd"), FRAME).tobytes() == RAW
    assert decode_tensor(identity.replace(encoding="zstd"), _lying_frame(128)).tobytes() == RAW
