"""Issue 5: a matrix of hostile and malformed requests against real processes.

Three processes are started once for the module: ``last`` (a meshnet-node
without --next), ``relay`` (a meshnet-node whose --next is ``last``) and a
``gateway`` in front of ``relay``. Every row of MATRIX is raw request bytes,
sent over its own TCP connection, with the exact status and wire-2 §4 error
code it must get. After the whole matrix (and the session flood and the
slow clients below) every process still serves a valid chunk bit-exactly and
the relay's memory has not grown by more than MEMORY_BOUND.
"""

from __future__ import annotations

import concurrent.futures
import select
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import zstandard

from support.gateway import spawn, stop
from support.security import (
    BODY,
    TENSOR,
    Pairs,
    chunked,
    connect,
    get,
    metric,
    new_session,
    parse_answer,
    replacing,
    request,
    rss_kib,
    send,
    valid_chunk_round_trip,
    wire,
    without,
)
from support.waiting import holds_within
from tests.proto.test_zstd_bomb import GiB, rle_bomb

MiB = 1 << 20
MAX_TENSOR = 16 * MiB
MAX_STORED = 16 * MiB
MAX_INFLIGHT = 64 * MiB
MAX_SESSIONS = 128
GATEWAY_SESSIONS = 48  # the gateway's own table, kept small so its flood is quick
HEAD_TIMEOUT = 2.0
# What the relay node's resident memory may grow by over the whole module
# (matrix, 10,000-session flood, slow clients), measured against its RSS after
# warm-up. Everything a peer can make it keep is budgeted: answers stored for
# replay (--max-stored-bytes, 16 MiB) and tensors of requests in flight
# (--max-inflight-bytes, 64 MiB); 16 MiB more for buffers and the allocator.
# docs/security.md quotes it.
MEMORY_BOUND = MAX_STORED + MAX_INFLIGHT + 16 * MiB

FLAGS = [
    "--max-tensor-bytes", str(MAX_TENSOR),
    "--max-stored-bytes", str(MAX_STORED),
    "--max-inflight-bytes", str(MAX_INFLIGHT),
    "--max-sessions", str(MAX_SESSIONS),
    # These processes test the table's global bound: every request here comes
    # from one client (127.0.0.1), so the per-client quota (wire-2 §3.9) is off;
    # tests/test_session_ownership.py tests the quota.
    "--max-sessions-per-client", "0",
    "--head-timeout", str(HEAD_TIMEOUT),
    "--reorder-timeout", "1",
]  # fmt: skip


@dataclass
class Procs:
    last: subprocess.Popen[str]
    relay: subprocess.Popen[str]
    gateway: subprocess.Popen[str]
    urls: dict[str, str]
    baseline_kib: int


@pytest.fixture(scope="module")
def procs() -> Iterator[Procs]:
    started: list[subprocess.Popen[str]] = []
    try:
        last, last_url = spawn("meshnet_node", *FLAGS)
        started.append(last)
        relay, relay_url = spawn("meshnet_node", *FLAGS, "--next", last_url)
        started.append(relay)
        gateway, gateway_url = spawn(
            "meshnet_gateway", *FLAGS, "--max-sessions", str(GATEWAY_SESSIONS), "--entry", relay_url
        )
        started.append(gateway)
        urls = {"last": last_url, "relay": relay_url, "gateway": gateway_url}
        # Warm up (imports, first zstd contexts, thread pools), then measure.
        for url in urls.values():
            valid_chunk_round_trip(url)
        big = TENSOR.repeat(1024 * 16, axis=1)  # a 1 MiB tensor, identity and zstd
        for encoding in (b"identity", b"zstd"):
            body = big.tobytes()
            if encoding == b"zstd":
                body = zstandard.ZstdCompressor().compress(body)
            pairs = wire(new_session(), shape=b"1,65536,4", encoding=encoding)
            assert send(relay_url, request(pairs, body)).status == 200
        baseline, _ = rss_kib(relay.pid)
        yield Procs(last, relay, gateway, urls, baseline)
        for proc in reversed(started):
            assert stop(proc) == 0
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# ---------------------------------------------------------------- the matrix

Build = Callable[[], list[bytes]]


@dataclass(frozen=True)
class Row:
    name: str
    target: str  # "last" | "relay" | "gateway"
    build: Build  # requests; all but the last must get 200
    status: int
    code: str | None
    header: str | None = None  # the error body's "header", when it names one


def one(pairs_of: Callable[[str], Pairs], body: bytes = BODY, **kw) -> Build:
    return lambda: [request(pairs_of(new_session()), body, **kw)]


class _Rows(list[Row]):
    """Rows for one target; ``row(name, pairs_of, status, code, header)`` adds one."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def row(self, name: str, pairs_of: Callable[[str], Pairs], status: int, code: str,
            header: str | None = None) -> None:  # fmt: skip
        self.append(Row(f"{self.target}:{name}", self.target, one(pairs_of), status, code, header))


def integer_rows(target: str) -> list[Row]:
    """The strict integer grammar, in every integer header."""
    rows = _Rows(target)
    row = rows.row
    integer = [
        ("sign_plus", b"+0"),
        ("sign_minus", b"-0"),
        ("leading_zero", b"00"),
        ("inner_space", b"0 0"),
        ("tab", b"0\t0"),
        ("30_digits", b"1" * 30),
        ("arabic_indic_digit", "\u0660".encode()),
        ("fullwidth_digit", "\uff10".encode()),
        ("hex", b"0x0"),
        ("empty", b""),
    ]
    for name, value in integer:
        row(
            f"index_{name}",
            lambda s, v=value: replacing(wire(s), b"X-Meshnet-Chunk-Index", v),
            400,
            "bad_integer",
            "x-meshnet-chunk-index",
        )
    for name, value in integer:
        row(
            f"total_{name}",
            lambda s, v=value: replacing(wire(s), b"X-Meshnet-Chunk-Total", v),
            400,
            "bad_integer",
            "x-meshnet-chunk-total",
        )
    for name, value in integer:
        row(
            f"position_{name}",
            lambda s, v=value: [*wire(s), (b"X-Meshnet-Position", v)],
            400,
            "bad_integer",
            "x-meshnet-position",
        )
        row(
            f"deadline_{name}",
            lambda s, v=value: [*wire(s), (b"X-Meshnet-Deadline-Ms", v)],
            400,
            "bad_integer",
            "x-meshnet-deadline-ms",
        )
    return rows


def header_value_rows(target: str) -> list[Row]:
    """The other headers of wire-2 §2: empty, conflicting, odd values."""
    rows = _Rows(target)
    row = rows.row
    for name, pairs_of, status, code, header in [
        ("wire_empty", lambda s: replacing(wire(s), b"X-Meshnet-Wire", b""), 400,
         "wire_version_mismatch", "x-meshnet-wire"),
        ("wire_leading_zero", lambda s: replacing(wire(s), b"X-Meshnet-Wire", b"02"), 400,
         "wire_version_mismatch", "x-meshnet-wire"),
        ("wire_sign", lambda s: replacing(wire(s), b"X-Meshnet-Wire", b"+2"), 400,
         "wire_version_mismatch", "x-meshnet-wire"),
        ("wire_30_digits", lambda s: replacing(wire(s), b"X-Meshnet-Wire", b"2" * 30), 400,
         "wire_version_mismatch", "x-meshnet-wire"),
        ("wire_non_ascii", lambda s: replacing(wire(s), b"X-Meshnet-Wire", "\u0662".encode()),
         400, "wire_version_mismatch", "x-meshnet-wire"),
        ("wire_conflicting", lambda s: [*wire(s), (b"X-Meshnet-Wire", b"1")], 400,
         "duplicate_header", "x-meshnet-wire"),
        ("encoding_empty", lambda s: wire(s, encoding=b""), 400, "bad_encoding",
         "x-meshnet-encoding"),
        ("encoding_repeated", lambda s: [*wire(s, encoding=b"identity"),
                                         (b"X-Meshnet-Encoding", b"identity")],
         400, "duplicate_header", "x-meshnet-encoding"),
        ("encoding_non_ascii", lambda s: wire(s, encoding="zst\u0434".encode()), 400,
         "bad_encoding", "x-meshnet-encoding"),
        ("dtype_conflicting", lambda s: [*wire(s), (b"X-Meshnet-Dtype", b"int32")], 400,
         "duplicate_header", "x-meshnet-dtype"),
        ("position_repeated", lambda s: [*wire(s, position=0), (b"X-Meshnet-Position", b"0")],
         400, "duplicate_header", "x-meshnet-position"),
        ("deadline_conflicting", lambda s: [*wire(s), (b"X-Meshnet-Deadline-Ms", b"5"),
                                            (b"X-Meshnet-Deadline-Ms", b"6")],
         400, "duplicate_header", "x-meshnet-deadline-ms"),
        ("content_type_empty", lambda s: replacing(wire(s), b"Content-Type", b""), 415,
         "unsupported_media_type", "content-type"),
        ("content_type_repeated", lambda s: [*wire(s), (b"Content-Type",
                                                        b"application/octet-stream")],
         400, "duplicate_header", "content-type"),
        ("content_type_conflicting", lambda s: [*wire(s), (b"Content-Type", b"text/plain")],
         400, "duplicate_header", "content-type"),
        ("content_type_non_ascii", lambda s: replacing(wire(s), b"Content-Type",
                                                       "application/\u00f6ctet-stream".encode()),
         415, "unsupported_media_type", "content-type"),
    ]:  # fmt: skip
        row(name, pairs_of, status, code, header)
    return rows


def content_length_rows(target: str) -> list[Row]:
    """Content-Length values, canonical or not."""
    rows = _Rows(target)
    for name, value, status, code in [
        ("content_length_empty", b"", 400, "bad_framing"),
        ("content_length_sign_minus", b"-64", 400, "bad_framing"),
        ("content_length_inner_space", b"6 4", 400, "bad_framing"),
        ("content_length_non_ascii", "\u0666\u0664".encode(), 400, "bad_framing"),
        ("content_length_hex", b"0x40", 400, "bad_framing"),
        ("content_length_leading_zeros", b"00064", 200, None),
    ]:
        rows.append(Row(f"{target}:{name}", target, one(wire, length=value), status, code))
    return rows


def missing_header_rows(target: str) -> list[Row]:
    """Each required header absent."""
    rows = _Rows(target)
    row = rows.row
    for header, code in [
        (b"X-Meshnet-Shape", "missing_header"),
        (b"X-Meshnet-Dtype", "missing_header"),
        (b"X-Meshnet-Session", "missing_header"),
        (b"X-Meshnet-Chunk-Index", "missing_header"),
        (b"X-Meshnet-Chunk-Total", "missing_header"),
    ]:
        row(
            f"missing_{header.decode()[10:].lower()}",
            lambda s, h=header: without(wire(s), h),
            400,
            code,
            header.decode().lower(),
        )
    return rows


def repeated_header_rows(target: str) -> list[Row]:
    """Each header twice, equal or conflicting."""
    rows = _Rows(target)
    row = rows.row
    for header in (
        b"X-Meshnet-Shape",
        b"X-Meshnet-Dtype",
        b"X-Meshnet-Session",
        b"X-Meshnet-Chunk-Index",
        b"X-Meshnet-Chunk-Total",
        b"X-Meshnet-Wire",
    ):
        short = header.decode()[10:].lower()
        row(
            f"repeated_{short}",
            lambda s, h=header: [*wire(s), (h, dict(wire(s))[h])],
            400,
            "duplicate_header",
            header.decode().lower(),
        )
    row(
        "conflicting_shape",
        lambda s: [*wire(s), (b"X-Meshnet-Shape", b"1,2,8")],
        400,
        "duplicate_header",
        "x-meshnet-shape",
    )
    row(
        "conflicting_index",
        lambda s: [*wire(s, total=2), (b"X-Meshnet-Chunk-Index", b"1")],
        400,
        "duplicate_header",
        "x-meshnet-chunk-index",
    )
    row(
        "conflicting_session",
        lambda s: [*wire(s), (b"X-Meshnet-Session", new_session().encode())],
        400,
        "duplicate_header",
        "x-meshnet-session",
    )
    row(
        "conflicting_encoding",
        lambda s: [*wire(s, encoding=b"identity"), (b"X-Meshnet-Encoding", b"zstd")],
        400,
        "duplicate_header",
        "x-meshnet-encoding",
    )
    return rows


def session_and_index_rows(target: str) -> list[Row]:
    """Session ids that are not canonical UUIDs; index against total."""
    rows = _Rows(target)
    row = rows.row
    for name, value in [
        ("empty", b""),
        ("uppercase", None),
        ("not_a_uuid", b"session-1"),
        ("braced", None),
        ("non_ascii", "5b1e0c2a-9f3d-4c1e-8a7b-0123456789\u00e4b".encode()),
    ]:

        def session_pairs(s: str, v=value, kind=name) -> Pairs:
            text = {"uppercase": s.upper().encode(), "braced": b"{" + s.encode() + b"}"}
            return replacing(wire(s), b"X-Meshnet-Session", v if v is not None else text[kind])

        row(f"session_{name}", session_pairs, 400, "bad_session", "x-meshnet-session")
    row(
        "index_equals_total",
        lambda s: wire(s, index=1, total=1),
        400,
        "bad_chunk_index",
        "x-meshnet-chunk-index",
    )
    row("total_zero", lambda s: wire(s, index=0, total=0), 400, "bad_chunk_index")
    return rows


def node_rows(target: str) -> list[Row]:
    """Header rows that hold for any node (session, index and total required)."""
    return [
        *integer_rows(target),
        *header_value_rows(target),
        *content_length_rows(target),
        *missing_header_rows(target),
        *repeated_header_rows(target),
        *session_and_index_rows(target),
    ]


def shape_rows(target: str, session: bool) -> list[Row]:
    """The shape and dtype rows, for nodes (session=True) and the gateway."""
    rows: list[Row] = []

    def base(s: str, **kw) -> Pairs:
        if session:
            return wire(s, **kw)
        return wire(None, index=None, total=None, **kw)

    def row(name: str, shape: bytes, status: int, code: str) -> None:
        rows.append(
            Row(
                f"{target}:shape_{name}",
                target,
                one(lambda s: base(s, shape=shape)),
                status,
                code,
                "x-meshnet-shape",
            )
        )

    row("empty_rank_0", b"", 400, "bad_shape")
    row("rank_9", b"1,1,1,1,1,1,1,1,1", 400, "bad_shape")
    row("zero_dimension", b"1,0,4", 400, "bad_shape")
    row("sign", b"1,+4,4", 400, "bad_shape")
    row("leading_zero", b"1,04,4", 400, "bad_shape")
    row("space_after_comma", b"1, 4,4", 400, "bad_shape")
    row("double_comma", b"1,,4", 400, "bad_shape")
    row("trailing_comma", b"1,4,4,", 400, "bad_shape")
    row("30_digit_dimension", b"1," + b"9" * 30, 400, "bad_shape")
    row("non_ascii_digit", "1,\u0664,4".encode(), 400, "bad_shape")
    row("count_overflows_64_bits", b"4294967296,4294967296,16", 413, "tensor_too_large")
    row("over_the_limit", b"1,4096,1025", 413, "tensor_too_large")

    def dtype_row(name: str, dtype: bytes, status: int, code: str) -> None:
        rows.append(
            Row(
                f"{target}:dtype_{name}",
                target,
                one(lambda s: base(s, dtype=dtype)),
                status,
                code,
                "x-meshnet-dtype",
            )
        )

    dtype_row("empty", b"", 400, "bad_dtype")
    dtype_row("wrong_case", b"Float32", 400, "bad_dtype")
    dtype_row("float64_unsupported", b"float64", 415, "unsupported_dtype")
    dtype_row("non_ascii", "flo\u0430t32".encode(), 400, "bad_dtype")
    rows.append(
        Row(
            f"{target}:dtype_missing",
            target,
            one(lambda s: without(base(s), b"X-Meshnet-Dtype")),
            400,
            "missing_header",
            "x-meshnet-dtype",
        )
    )
    rows.append(
        Row(
            f"{target}:wire_1",
            target,
            one(lambda s: replacing(base(s), b"X-Meshnet-Wire", b"1")),
            400,
            "wire_version_mismatch",
            "x-meshnet-wire",
        )
    )
    rows.append(
        Row(
            f"{target}:encoding_gzip",
            target,
            one(lambda s: base(s, encoding=b"gzip")),
            415,
            "unsupported_encoding",
            "x-meshnet-encoding",
        )
    )
    rows.append(
        Row(
            f"{target}:encoding_wrong_case",
            target,
            one(lambda s: base(s, encoding=b"ZSTD")),
            400,
            "bad_encoding",
            "x-meshnet-encoding",
        )
    )
    return rows


def _sender(session: bool) -> Callable[..., Pairs]:
    """Wire headers with the sequencing trio (a node's input) or without (a gateway's)."""

    def base(s: str, **kw) -> Pairs:
        return wire(s, **kw) if session else wire(None, index=None, total=None, **kw)

    return base


def media_rows(target: str, session: bool) -> list[Row]:
    """Content type and wire 1 (any server)."""
    base, t = _sender(session), target
    wire1 = b'{"shape":[1,4,4],"dtype":"float32","data":[0.0]}'
    return [
        Row(
            f"{t}:content_type_missing",
            t,
            one(lambda s: without(base(s), b"Content-Type")),
            415,
            "unsupported_media_type",
        ),
        Row(
            f"{t}:content_type_text",
            t,
            one(lambda s: replacing(base(s), b"Content-Type", b"text/plain")),
            415,
            "unsupported_media_type",
        ),
        Row(
            f"{t}:wire1_json_body",
            t,
            one(
                lambda s: [
                    (b"Content-Type", b"application/json"),
                    *(p for p in base(s) if p[0] != b"Content-Type"),
                ],
                wire1,
            ),
            415,
            "wire1_gone",
        ),
        Row(
            f"{t}:wire1_json_no_headers",
            t,
            one(lambda s: [(b"Content-Type", b"application/json")], wire1),
            415,
            "wire1_gone",
        ),
    ]


def framing_rows(target: str, session: bool) -> list[Row]:
    """Body size and HTTP framing: the request line, lengths, chunked (any server)."""
    base, t = _sender(session), target
    return [
        Row(f"{t}:body_shorter", t, one(base, BODY[:-4]), 400, "body_size_mismatch"),
        Row(f"{t}:body_longer", t, one(base, BODY + b"1234"), 413, "body_too_large"),
        Row(f"{t}:body_absent_cl_0", t, one(base, b""), 400, "body_size_mismatch"),
        Row(f"{t}:no_length_at_all", t, one(base, b"", length=None), 411, "length_required"),
        Row(
            f"{t}:cl_and_chunked_smuggling",
            t,
            one(
                lambda s: [*base(s), (b"Transfer-Encoding", b"chunked")],
                chunked(BODY),
                length=b"%d" % len(BODY),
            ),
            400,
            "bad_framing",
        ),
        Row(
            f"{t}:chunked_bad_size_line",
            t,
            one(
                lambda s: [*base(s), (b"Transfer-Encoding", b"chunked")],
                b"4g\r\n" + BODY + b"\r\n0\r\n\r\n",
                length=None,
            ),
            400,
            "malformed_request",
        ),
        Row(
            f"{t}:chunked_size_30_hex_digits",
            t,
            one(
                lambda s: [*base(s), (b"Transfer-Encoding", b"chunked")],
                b"f" * 30 + b"\r\n" + BODY,
                length=None,
            ),
            400,
            "malformed_request",
        ),
        Row(
            f"{t}:chunked_data_overruns_its_size",
            t,
            one(
                lambda s: [*base(s), (b"Transfer-Encoding", b"chunked")],
                b"10\r\n" + BODY[:32] + b"\r\n0\r\n\r\n",
                length=None,
            ),
            400,
            "malformed_request",
        ),
        Row(
            f"{t}:chunked_then_eof",
            t,
            one(
                lambda s: [*base(s), (b"Transfer-Encoding", b"chunked")],
                b"40\r\n" + BODY[:20],
                length=None,
            ),
            400,
            "malformed_request",
        ),
        Row(
            f"{t}:content_length_leading_plus",
            t,
            one(base, length=b"+64"),
            400,
            "bad_framing",
        ),
        Row(
            f"{t}:content_length_30_digits",
            t,
            one(base, length=b"9" * 30),
            400,
            "bad_framing",
        ),
        Row(
            f"{t}:header_block_over_16k",
            t,
            one(lambda s: [*base(s), (b"X-Pad", b"p" * (17 * 1024))]),
            431,
            "header_block_too_large",
        ),
        Row(
            f"{t}:many_small_headers_over_16k",
            t,
            one(lambda s: [*base(s), *((b"X-P%d" % i, b"v") for i in range(2000))]),
            431,
            "header_block_too_large",
        ),
        Row(f"{t}:http_1_0_is_fine", t, one(base, version=b"HTTP/1.0", close=False), 200, None),
        Row(f"{t}:http_2_0_line", t, one(base, version=b"HTTP/2.0"), 400, "malformed_request"),
        Row(f"{t}:lowercase_version", t, one(base, version=b"http/1.1"), 400, "malformed_request"),
        Row(
            f"{t}:no_version_http_0_9",
            t,
            lambda: [b"POST /forward\r\n\r\n"],
            400,
            "malformed_request",
        ),
        Row(
            f"{t}:h2_preface",
            t,
            lambda: [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"],
            400,
            "malformed_request",
        ),
        Row(f"{t}:lowercase_method", t, one(base, method=b"post"), 405, "method_not_allowed"),
        Row(f"{t}:method_put", t, one(base, method=b"PUT"), 405, "method_not_allowed"),
        Row(
            f"{t}:absolute_form_target",
            t,
            one(base, target=b"http://127.0.0.1:1/forward"),
            404,
            "not_found",
        ),
        Row(
            f"{t}:nul_in_header",
            t,
            one(lambda s: [*base(s), (b"X-Foo", b"a\x00b")]),
            400,
            "malformed_request",
        ),
    ]


def zstd_rows(target: str, session: bool) -> list[Row]:
    """zstd bodies: truncated, trailing bytes, wrong sizes, bombs (any server)."""
    base, t = _sender(session), target
    z = zstandard.ZstdCompressor()
    frame = z.compress(BODY)
    big_shape = b"1,1024,1024"  # 4 MiB of float32: bound large enough for a bomb
    return [
        Row(
            f"{t}:zstd_garbage",
            t,
            one(lambda s: base(s, encoding=b"zstd"), b"this is not zstd at all"),
            400,
            "bad_zstd_frame",
        ),
        Row(
            f"{t}:zstd_truncated",
            t,
            one(lambda s: base(s, encoding=b"zstd"), frame[:-3]),
            400,
            "bad_zstd_frame",
        ),
        Row(
            f"{t}:zstd_trailing_bytes",
            t,
            one(lambda s: base(s, encoding=b"zstd"), frame + b"\x00\x01"),
            400,
            "bad_zstd_frame",
        ),
        Row(
            f"{t}:zstd_decodes_short",
            t,
            one(lambda s: base(s, encoding=b"zstd"), z.compress(BODY[:-4])),
            400,
            "body_size_mismatch",
        ),
        Row(
            f"{t}:zstd_decodes_long",
            t,
            one(lambda s: base(s, encoding=b"zstd"), z.compress(BODY + BODY[:4])),
            400,
            "body_size_mismatch",
        ),
        Row(
            f"{t}:zstd_bomb_1_gib_from_32_kib",
            t,
            one(lambda s: base(s, shape=big_shape, encoding=b"zstd"), rle_bomb(GiB)),
            400,
            "body_size_mismatch",
        ),
        Row(
            f"{t}:zstd_bomb_declaring_4_gib",
            t,
            one(
                lambda s: base(s, shape=big_shape, encoding=b"zstd"),
                rle_bomb(2 * 128 * 1024, declares=4 * GiB),
            ),
            400,
            "body_size_mismatch",
        ),
        Row(
            f"{t}:zstd_bomb_declaring_the_promise",
            t,
            one(
                lambda s: base(s, shape=big_shape, encoding=b"zstd"),
                rle_bomb(GiB, declares=4 * MiB),
            ),
            400,
            "bad_zstd_frame",
        ),
    ]


def content_rows(target: str, session: bool) -> list[Row]:
    """Content type, wire 1, framing and body rows (any server)."""
    return [
        *media_rows(target, session),
        *framing_rows(target, session),
        *zstd_rows(target, session),
    ]


def sequencing_rows(target: str) -> list[Row]:
    t = target
    other = (TENSOR + 1).tobytes()

    def run(*steps: tuple[dict, bytes]) -> Build:
        # Every chunk carries its position (wire-2 §3.9: only a new session's
        # first chunk may omit it), the run's 4 tokens a chunk, unless a step
        # names its own (None: omitted).
        def build() -> list[bytes]:
            s = new_session()
            return [
                request(wire(s, **{"position": 4 * kw["index"], **kw}), body) for kw, body in steps
            ]

        return build

    return [
        Row(
            f"{t}:skipped_index_times_out",
            t,
            run(({"index": 0, "total": 4}, BODY), ({"index": 2, "total": 4}, BODY)),
            409,
            "chunk_wait_timeout",
        ),
        Row(
            f"{t}:index_beyond_window",
            t,
            run(({"index": 0, "total": 64}, BODY), ({"index": 40, "total": 64}, BODY)),
            409,
            "chunk_out_of_window",
        ),
        Row(
            f"{t}:replayed_index_other_body",
            t,
            run(({"index": 0, "total": 2}, BODY), ({"index": 0, "total": 2}, other)),
            409,
            "chunk_conflict",
        ),
        Row(
            f"{t}:total_changed_mid_run",
            t,
            run(({"index": 0, "total": 3}, BODY), ({"index": 1, "total": 4}, BODY)),
            409,
            "run_mismatch",
        ),
        Row(
            f"{t}:dtype_changed_mid_run",
            t,
            run(
                ({"index": 0, "total": 2}, BODY),
                ({"index": 1, "total": 2, "dtype": b"int32"}, BODY),
            ),
            409,
            "run_mismatch",
        ),
        Row(
            f"{t}:hidden_dim_changed_mid_run",
            t,
            run(
                ({"index": 0, "total": 2}, BODY),
                ({"index": 1, "total": 2, "shape": b"1,2,8"}, BODY),
            ),
            409,
            "run_mismatch",
        ),
        Row(
            f"{t}:stale_position",
            t,
            run(
                ({"index": 0, "total": 2, "position": 0}, BODY),
                ({"index": 1, "total": 2, "position": 0}, BODY),
            ),
            409,
            "position_mismatch",
        ),
        Row(
            f"{t}:position_ahead",
            t,
            run(
                ({"index": 0, "total": 2, "position": 0}, BODY),
                ({"index": 1, "total": 2, "position": 9}, BODY),
            ),
            409,
            "position_mismatch",
        ),
        Row(
            f"{t}:session_reused_with_another_shape_mid_run",
            t,
            run(
                ({"index": 0, "total": 2}, BODY),
                ({"index": 0, "total": 2, "shape": b"1,2,8"}, BODY),
            ),
            409,
            "run_mismatch",
        ),
        # wire-2 §3 fixes the trailing shape within a run only: a finished run
        # may be followed by one of another shape, served as what it is.
        Row(
            f"{t}:session_reused_with_another_shape_next_run",
            t,
            run(
                ({"index": 0, "total": 1, "position": 0}, BODY),
                ({"index": 0, "total": 1, "position": 4, "shape": b"1,2,8"}, BODY),
            ),
            200,
            None,
        ),
        Row(
            f"{t}:append_without_position",
            t,
            run(
                ({"index": 0, "total": 2}, BODY), ({"index": 1, "total": 2, "position": None}, BODY)
            ),
            409,
            "position_required",
            "x-meshnet-position",
        ),
        Row(
            f"{t}:next_run_without_position",
            t,
            run(
                ({"index": 0, "total": 1, "position": None}, BODY),
                ({"index": 0, "total": 1, "position": None}, BODY),
            ),
            409,
            "position_required",
            "x-meshnet-position",
        ),
        Row(
            f"{t}:unknown_session_at_position_gt_0",
            t,
            run(({"index": 0, "total": 1, "position": 8}, BODY)),
            409,
            "session_unknown",
        ),
    ]


def gateway_rows() -> list[Row]:
    g = "gateway"

    def base(s: str, **kw) -> Pairs:
        return wire(None, index=None, total=None, **kw)

    return [
        Row(
            f"{g}:chunk_index_1",
            g,
            one(lambda s: wire(None, index=1, total=2)),
            400,
            "bad_chunk_index",
            "x-meshnet-chunk-total",
        ),
        Row(
            f"{g}:session_not_canonical",
            g,
            one(lambda s: [*base(s), (b"X-Meshnet-Session", s.upper().encode())]),
            400,
            "bad_session",
            "x-meshnet-session",
        ),
        Row(
            f"{g}:client_session_unknown_at_gateway_ok",
            g,
            one(lambda s: [*base(s), (b"X-Meshnet-Session", s.encode())]),
            200,
            None,
        ),
    ]


MATRIX: list[Row] = [
    *node_rows("last"),
    *shape_rows("last", session=True),
    *content_rows("last", session=True),
    *sequencing_rows("last"),
    *node_rows("relay")[:12],
    *shape_rows("relay", session=True),
    *content_rows("relay", session=True),
    *sequencing_rows("relay"),
    *shape_rows("gateway", session=False),
    *content_rows("gateway", session=False),
    *gateway_rows(),
]


def check_row(urls: dict[str, str], row: Row) -> str | None:
    """None if the row got what it must, else what went wrong."""
    url = urls[row.target]
    *setup, last = row.build()
    for step in setup:
        answer = send(url, step)
        if answer.status != 200:
            return f"setup step got {answer.status}: {answer.body[:300]!r}"
    answer = send(url, last)
    got = (answer.status, answer.code)
    if got != (row.status, row.code):
        return f"expected {(row.status, row.code)}, got {got}: {answer.body[:300]!r}"
    if answer.status >= 400:
        error = answer.error
        if answer.headers.get(b"content-type") != b"application/json":
            return f"error without JSON content type: {answer.headers}"
        if set(error) != {"status", "code", "message", "header", "hop"}:
            return f"error body not wire-2 §4: {error}"
        if error["status"] != answer.status:
            return f"body status {error['status']} != {answer.status}"
        if row.header is not None and error["header"] != row.header:
            return f"header {error['header']!r}, expected {row.header!r}"
        if row.code == "wire1_gone" and "wire 1" not in error["message"]:
            return f"415 does not say wire 1 is gone: {error['message']!r}"
        if row.target == "relay" and error["hop"] is not None:
            return f"the relay's own verdict names a hop: {error}"
    elif row.target != "gateway" and answer.body != BODY:
        return "200 but not the echo of the request"
    return None


def test_the_matrix_is_large_and_covers_every_process() -> None:
    assert len(MATRIX) >= 60
    assert len({row.name for row in MATRIX}) == len(MATRIX)
    assert {row.target for row in MATRIX} == {"last", "relay", "gateway"}
    assert {row.status for row in MATRIX} >= {400, 404, 405, 409, 411, 413, 415, 431}


def test_hostile_matrix_against_real_processes(procs: Procs) -> None:
    failures = {}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = pool.map(lambda row: (row.name, check_row(procs.urls, row)), MATRIX)
        for name, failure in results:
            if failure is not None:
                failures[name] = failure
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())
    for url in procs.urls.values():
        valid_chunk_round_trip(url)
    for proc in (procs.last, procs.relay, procs.gateway):
        assert proc.poll() is None


# ------------------------------------------------- forward only to --next


def test_nothing_in_a_request_makes_a_node_connect_elsewhere(procs: Procs) -> None:
    decoy = socket.socket()
    decoy.bind(("127.0.0.1", 0))
    decoy.listen(64)
    decoy.setblocking(False)
    port = decoy.getsockname()[1]
    evil = f"127.0.0.1:{port}".encode()
    evil_url = b"http://" + evil
    tricks = [
        (b"X-Meshnet-Next", evil_url),
        (b"X-Forwarded-Host", evil),
        (b"X-Forwarded-For", b"127.0.0.1"),
        (b"X-Forwarded-Proto", b"http"),
        (b"Forwarded", b"for=127.0.0.1;host=" + evil),
        (b"X-Meshnet-Hop", evil_url),
        (b"Via", b"1.1 " + evil),
    ]
    try:
        for target in ("relay", "gateway"):
            url = procs.urls[target]
            for name, value in tricks:
                pairs = wire(new_session()) if target == "relay" else wire(None)
                answer = send(url, request([*pairs, (name, value)], host=evil))
                assert answer.status == 200 and answer.body == BODY
            for form in (evil_url + b"/forward", b"//" + evil + b"/forward"):
                answer = send(url, request(wire(new_session()), target=form, host=evil))
                assert (answer.status, answer.code) == (404, "not_found")
            answer = send(url, b"CONNECT " + evil + b" HTTP/1.1\r\nHost: " + evil + b"\r\n\r\n")
            assert answer.status in (400, 404, 405)
            # Deep health and DELETE go to the configured --next only.
            health = get(url, "/health?deep=1")
            assert health.status == 200
            sid = new_session()
            delete = send(
                url,
                b"DELETE /sessions/" + sid.encode() + b" HTTP/1.1\r\nHost: " + evil + b"\r\n"
                b"X-Meshnet-Next: " + evil_url + b"\r\nConnection: close\r\n\r\n",
            )
            assert delete.status == 404
        with pytest.raises(BlockingIOError):
            decoy.accept()  # not one connection reached the decoy
    finally:
        decoy.close()


# ----------------------------------------------------- ten thousand sessions

FLOOD = 10_000


def test_ten_thousand_sessions_at_once_are_bounded(procs: Procs) -> None:
    url = procs.urls["last"]
    sessions = [new_session() for _ in range(FLOOD)]

    def open_one(session: str) -> tuple[str, int, str | None, bytes | None]:
        answer = send(url, request(wire(session, index=0, total=2)))
        return session, answer.status, answer.code, answer.headers.get(b"retry-after")

    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        results = list(pool.map(open_one, sessions))
    admitted = [s for s, status, _, _ in results if status == 200]
    refused = [(status, code, retry) for _, status, code, retry in results if status != 200]
    assert 0 < len(admitted) <= MAX_SESSIONS
    assert len(admitted) + len(refused) == FLOOD
    assert refused, "10,000 sessions must overflow --max-sessions"
    for status, code, retry in refused:
        assert status == 503 and code in ("sessions_full", "too_many_connections")
        assert retry is not None and retry.isdigit()
    assert metric(url, "meshnet_sessions") <= MAX_SESSIONS
    # Healthy: health, and (after freeing the table) a new session serves.
    assert get(url, "/health").status == 200
    for session in admitted:
        delete = f"DELETE /sessions/{session} HTTP/1.1\r\nHost: [::1]\r\nConnection: close\r\n\r\n"
        assert send(url, delete.encode()).status == 204
    valid_chunk_round_trip(url)
    valid_chunk_round_trip(procs.urls["gateway"])


def test_a_session_flood_at_the_gateway_is_bounded_too(procs: Procs) -> None:
    url = procs.urls["gateway"]

    def open_one(session: str) -> tuple[str, int, str | None, bytes | None, bytes | None]:
        pairs = [*wire(None, index=None, total=None), (b"X-Meshnet-Session", session.encode())]
        answer = send(url, request(pairs))
        # A session the gateway creates for a client that sent no key gets one,
        # returned once in this answer (wire-2 §3.9); the DELETE needs it.
        key = answer.headers.get(b"x-meshnet-session-key")
        return session, answer.status, answer.code, answer.headers.get(b"retry-after"), key

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(open_one, [new_session() for _ in range(3 * GATEWAY_SESSIONS)]))
    admitted = {s: key for s, status, _, _, key in results if status == 200}
    assert 0 < len(admitted) <= GATEWAY_SESSIONS
    assert all(key is not None for key in admitted.values())
    for _, status, code, retry, _ in results:
        if status != 200:
            assert (status, code) == (503, "sessions_full") and retry is not None
    # The client's DELETE frees its sessions at the gateway and down the chain.
    for session, key in admitted.items():
        delete = f"DELETE /sessions/{session} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
        delete += f"X-Meshnet-Session-Key: {key.decode()}\r\n\r\n"
        assert send(url, delete.encode()).status == 204
    valid_chunk_round_trip(url)


# ------------------------------------------------------------- slow clients


def connections(url: str) -> float:
    # /metrics is itself served on one connection: that one counts.
    return metric(url, "meshnet_connections") - 1


def wait_for(predicate: Callable[[], bool], seconds: float = 60.0) -> bool:
    return holds_within(predicate, timeout=seconds, every=0.1)


def test_headers_one_byte_a_second_get_408_and_leave_no_task(procs: Procs) -> None:
    url = procs.urls["relay"]
    baseline = connections(url)
    head = request(wire(new_session()))
    sock = connect(url)
    sent = 0
    answer = b""
    try:
        # 1 byte/s: the head (~300 bytes) would take minutes; the node's
        # --head-timeout (2 s) must end it long before 30 bytes went out.
        for byte in head[:30]:
            sock.sendall(bytes([byte]))
            sent += 1
            readable, _, _ = select.select([sock], [], [], 1.0)
            if readable:
                break
        answer = sock.recv(65536)
        while True:
            readable, _, _ = select.select([sock], [], [], 5.0)
            piece = sock.recv(65536) if readable else b""
            if not piece:
                break
            answer += piece
    finally:
        sock.close()
    assert sent < 30
    parsed = parse_answer(answer)
    assert (parsed.status, parsed.code) == (408, "request_timeout")
    assert wait_for(lambda: connections(url) <= baseline)


def fill_until_blocked(sock: socket.socket, make: Callable[[], bytes], limit: int) -> int:
    """Pipeline requests from ``make()`` without reading any answer, until a
    send has been blocked for half a second (the peer stopped reading) or ``limit``
    bytes went out; the bytes sent."""
    sock.setblocking(False)
    sent = 0
    pending = b""
    while sent < limit:
        pending = pending or make()
        try:
            count = sock.send(pending)
        except BlockingIOError:
            _, writable, _ = select.select([], [sock], [], 0.5)
            if not writable:
                return sent
            continue
        sent += count
        pending = pending[count:]
    return sent


def test_a_client_that_never_reads_does_not_block_others_or_grow_memory(procs: Procs) -> None:
    url = procs.urls["relay"]
    baseline = connections(url)
    big = TENSOR.repeat(4096 * 4, axis=1).tobytes()  # 1 MiB tensors, 1 MiB answers

    def one_request() -> bytes:
        return request(wire(new_session(), shape=b"1,65536,4"), big, close=False)

    limit = 256 * MiB
    stuck = []
    try:
        for _ in range(4):
            sock = connect(url)
            stuck.append(sock)
            # The node answers, its answers fill the socket buffers, its write
            # blocks, and then it stops reading requests: backpressure, not
            # memory. Were it to keep reading, this would send 256 MiB.
            assert fill_until_blocked(sock, one_request, limit) < limit
        # Others are served meanwhile, correctly.
        for _ in range(3):
            valid_chunk_round_trip(url)
        valid_chunk_round_trip(procs.urls["gateway"])
        rss, _ = rss_kib(procs.relay.pid)
        assert (rss - procs.baseline_kib) * 1024 < MEMORY_BOUND
    finally:
        for sock in stuck:
            sock.close()
    assert wait_for(lambda: connections(url) <= baseline, 30)


def test_a_client_disconnecting_mid_body_corrupts_nothing(procs: Procs) -> None:
    url = procs.urls["relay"]
    session = new_session()
    first = request(wire(session, index=0, total=2, position=0))
    assert send(url, first).status == 200
    second = request(wire(session, index=1, total=2, position=4))
    for cut in (len(second) - len(BODY) - 5, len(second) - 10):
        sock = connect(url)
        sock.sendall(second[:cut])
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()  # an abortive close: RST mid-request
    answer = send(url, second)
    assert answer.status == 200 and answer.body == BODY
    assert answer.headers[b"x-meshnet-position"] == b"4"
    valid_chunk_round_trip(url)


# ------------------------------------------------------- garbage downstream


class GarbageServer:
    """A loopback listener answering each request with ``self.answer``, then closing."""

    def __init__(self) -> None:
        self.answer = b""
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.sock.fileno() != -1:
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(65536)
                    conn.sendall(self.answer)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


GARBAGE = {
    # A banner, then the close: EOF before a complete answer (docs/wire-2.md §4.3).
    "ssh_banner": (b"SSH-2.0-OpenSSH_9.6\r\n", "downstream_unreachable"),
    "binary_head": (b"\x00\xffgarbage\x01\r\n\r\n", "downstream_bad_response"),
    "200_no_wire_headers": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
        "downstream_bad_response",
    ),
    "200_short_body": (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
        b"X-Meshnet-Shape: 1,4,4\r\nX-Meshnet-Dtype: float32\r\nContent-Length: 3\r\n\r\nabc",
        "downstream_bad_response",
    ),
    "500_not_json": (
        b"HTTP/1.1 500 Oops\r\nContent-Length: 4\r\n\r\n{{{{",
        "downstream_bad_response",
    ),
    "huge_length": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n",
        "downstream_bad_response",
    ),
    "closes_at_once": (b"", "downstream_unreachable"),
    "header_bomb": (b"HTTP/1.1 200 OK\r\nX-A: " + b"a" * (8 * MiB), "downstream_bad_response"),
    "many_headers": (b"HTTP/1.1 200 OK\r\n" + b"X-A: a\r\n" * 100_000, "downstream_bad_response"),
    "chunked_huge_chunk": (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
        b"X-Meshnet-Shape: 1,4,4\r\nX-Meshnet-Dtype: float32\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nffffffffff\r\n" + b"a" * MiB,
        "downstream_bad_response",
    ),
    "json_error_of_a_gigabyte": (
        b"HTTP/1.1 409 Conflict\r\nContent-Type: application/json\r\n"
        b"Content-Length: 999999999\r\n\r\n" + b"{" * MiB,
        "downstream_bad_response",
    ),
    "101_switching": (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n",
        "downstream_bad_response",
    ),
    "200_shape_bomb": (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
        b"X-Meshnet-Shape: 65536,65536,65536\r\nX-Meshnet-Dtype: float32\r\n"
        b"Content-Length: 64\r\n\r\n" + b"a" * 64,
        "downstream_bad_response",
    ),
}


def test_a_downstream_answering_garbage_is_502_not_500() -> None:
    garbage = GarbageServer()
    proc = None
    try:
        proc, node_url = spawn("meshnet_node", "--next", garbage.url, "--timeout", "5")
        for name, (answer_bytes, code) in GARBAGE.items():
            garbage.answer = answer_bytes
            answer = send(node_url, request(wire(new_session())))
            assert (answer.status, answer.code) == (502, code), (name, answer.raw[:400])
            assert answer.error["hop"] == garbage.url
            assert get(node_url, "/health").status == 200
        assert proc.poll() is None
    finally:
        garbage.close()
        if proc is not None:
            assert stop(proc) == 0


# -------------------------------------------------------------- afterwards


def test_after_everything_serves_bit_exact_and_memory_is_bounded(procs: Procs) -> None:
    for url in procs.urls.values():
        valid_chunk_round_trip(url)
    rss, hwm = rss_kib(procs.relay.pid)
    growth = (rss - procs.baseline_kib) * 1024
    print(
        f"relay RSS: baseline {procs.baseline_kib} KiB, now {rss} KiB "
        f"(growth {growth / MiB:.1f} MiB), peak {hwm} KiB"
    )
    assert growth < MEMORY_BOUND
    assert (hwm - procs.baseline_kib) * 1024 < 2 * MEMORY_BOUND
    for name, proc in (("last", procs.last), ("gateway", procs.gateway)):
        rss_other, _ = rss_kib(proc.pid)
        assert rss_other * 1024 < 512 * MiB, name
