"""wire-2 §3.11 in the core: the KV message's two headers, where they may
appear, its shape rules, the checksum, and a session adopted by an import."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from meshnet_proto import (
    ActivationHead,
    ActivationReceived,
    CapacityError,
    Limits,
    ProtocolError,
    ProtocolErrorReceived,
    SequencingError,
    ServerConnection,
    SessionTable,
    WireHeaders,
    encode_tensor,
)
from meshnet_proto._headers import parse_wire_headers
from meshnet_proto.lowlevel import DEFAULT_ROUTES, KV_RANK, kv_checksum

S = "5b1e0c2a-1111-4abc-8def-000000000001"
SUM = "0123456789abcdef"
FP = "0123456789abcdef0123456789abcdef"


def kv(positions: int = 3, dtype: str = "float32") -> np.ndarray:
    shape = (2, 2, 1, 2, positions, 4)  # [layers, 2, batch, kv_heads, positions, head_dim]
    values = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) / 9
    return values.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


def kv_headers(array: np.ndarray, **fields: object) -> WireHeaders:
    base: dict[str, object] = {
        "session": S,
        "chunk_index": 0,
        "chunk_total": 1,
        "position": array.shape[4],
        "kv_checksum": kv_checksum(array),
        "kv_fingerprint": FP,
    }
    base.update(fields)
    return WireHeaders.for_array(array, **base)


def request(headers: WireHeaders, array: np.ndarray, target: bytes = b"/forward?kv=1") -> bytes:
    body = bytes(encode_tensor(array, encoding=headers.encoding))
    lines = b"".join(n + b": " + v + b"\r\n" for n, v in headers.to_pairs())
    return (b"POST " + target + b" HTTP/1.1\r\nHost: node\r\n" + lines
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)  # fmt: skip


def events(data: bytes) -> list[object]:
    conn = ServerConnection()
    conn.receive_data(data)
    out = [conn.next_event()]
    if isinstance(out[0], ActivationHead):
        out.append(conn.next_event())
    return out


def test_a_kv_import_parses_with_its_headers_and_flag() -> None:
    array = kv()
    head, received = events(request(kv_headers(array), array))
    assert isinstance(head, ActivationHead) and head.kv_import and not head.replay
    assert isinstance(received, ActivationReceived) and received.kv_import
    assert received.headers.kv_checksum == kv_checksum(received.tensor)
    assert received.headers.kv_fingerprint == FP
    assert np.array_equal(received.tensor, array)
    names = [n for n, _ in kv_headers(array).to_pairs()]
    assert b"X-Meshnet-KV-Checksum" in names and b"X-Meshnet-KV-Fingerprint" in names
    assert KV_RANK == 6 and DEFAULT_ROUTES["/kv/*"] == ("GET",)


def test_the_checksum_is_xxh3_64_of_the_little_endian_bytes() -> None:
    array = kv(dtype="float16")
    assert kv_checksum(array) == xxhash.xxh3_64_hexdigest(array.astype("<f2").tobytes())
    assert kv_checksum(array.astype(">f2")) == kv_checksum(array)  # byte order: the value's
    assert kv_checksum(kv(dtype="bfloat16")) != kv_checksum(kv())


@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=4, max_side=5)))
def test_the_checksum_does_not_depend_on_layout(array: np.ndarray) -> None:
    assert kv_checksum(np.asfortranarray(array)) == kv_checksum(array)
    assert len(kv_checksum(array)) == 16


def _pairs(extra: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/octet-stream"), (b"x-meshnet-shape", b"1,2"),
            (b"x-meshnet-dtype", b"float32"), *extra]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (b"x-meshnet-kv-checksum", b"0123456789ABCDEF"),  # uppercase
        (b"x-meshnet-kv-checksum", b"0123"),  # short
        (b"x-meshnet-kv-fingerprint", b"0123456789abcdef"),  # a checksum's length
        (b"x-meshnet-kv-fingerprint", b"g" * 32),
    ],
)
def test_malformed_kv_headers_are_400_bad_kv(name: bytes, value: bytes) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_wire_headers(_pairs([(name, value)]), require_sequencing=False)
    assert (caught.value.code, caught.value.status, caught.value.header) == (
        "bad_kv", 400, name.decode())  # fmt: skip


def test_hand_built_headers_check_the_kv_fields() -> None:
    for bad in ({"kv_checksum": "x" * 16}, {"kv_fingerprint": SUM}, {"kv_checksum": 7},
                {"kv_fingerprint": "é" * 32}):  # fmt: skip
        with pytest.raises(ValueError):
            WireHeaders(shape=(1, 4), dtype="float32", **bad)  # type: ignore[arg-type]
    only_fp = WireHeaders(shape=(1,), dtype="float32", kv_fingerprint=FP)
    assert [n for n, _ in only_fp.to_pairs() if n.startswith(b"X-Meshnet-KV")] == [
        b"X-Meshnet-KV-Fingerprint"
    ]


def _refusal(data: bytes) -> ProtocolError:
    (event,) = events(data)[:1]
    assert isinstance(event, ProtocolErrorReceived), event
    assert isinstance(event.error, ProtocolError)
    return event.error


def test_kv_headers_on_an_ordinary_chunk_are_400_bad_kv() -> None:
    array = kv()
    for field in ("kv_checksum", "kv_fingerprint"):
        other = "kv_fingerprint" if field == "kv_checksum" else "kv_checksum"
        headers = kv_headers(array).replace(**{other: None})
        error = _refusal(request(headers, array, target=b"/forward"))
        assert (error.code, error.header) == ("bad_kv", f"x-meshnet-{field.replace('_', '-')}")


CASES = [
    ({"kv_checksum": None}, "x-meshnet-kv-checksum"),
    ({"kv_fingerprint": None}, "x-meshnet-kv-fingerprint"),
    ({"chunk_index": 1, "chunk_total": 2}, "x-meshnet-chunk-index"),
    ({"chunk_total": 2}, "x-meshnet-chunk-index"),
    ({"position": 2}, "x-meshnet-position"),
]


@pytest.mark.parametrize(("change", "header"), CASES)
def test_an_import_not_shaped_as_one_is_400_bad_kv(change: dict, header: str) -> None:
    array = kv()
    headers = kv_headers(array, **change)
    error = _refusal(request(headers, array))
    assert (error.code, error.status, error.header) == ("bad_kv", 400, header)


@pytest.mark.parametrize(
    ("positions", "change"), [(32, {"prefix": FP}), (62, {"prefix_blocks": (FP,)})]
)
def test_an_import_names_no_prefix(positions: int, change: dict) -> None:
    """Prefix headers whose own grammar and count hold (one layer: batch
    axis 1) are still no part of a KV import."""
    array = np.zeros((1, 2, 1, 2, positions, 4), np.float32)
    headers = kv_headers(array, **change)
    error = _refusal(request(headers, array))
    assert (error.code, error.header) == ("bad_kv", "x-meshnet-prefix")


@pytest.mark.parametrize(
    ("array", "header"),
    [
        (np.zeros((2, 2, 1, 2, 3), np.float32), "x-meshnet-shape"),  # rank 5
        (np.zeros((2, 3, 1, 2, 3, 4), np.float32), "x-meshnet-shape"),  # not keys and values
        (np.zeros((2, 2, 1, 2, 3, 4), np.int32), "x-meshnet-dtype"),
    ],
)
def test_an_import_whose_tensor_is_not_kv_is_400_bad_kv(array: np.ndarray, header: str) -> None:
    headers = kv_headers(array, position=3)
    error = _refusal(request(headers, array))
    assert (error.code, error.header) == ("bad_kv", header)


def test_a_table_adopts_an_imported_session_between_runs() -> None:
    table = SessionTable(Limits(max_sessions=2, max_sessions_per_client=1))
    table.check_adopt(S, 0.0, client="a")
    table.adopt(S, 40, 0.0, key=FP, client="a")
    assert table.position(S) == 40
    with pytest.raises(SequencingError) as exists:
        table.adopt(S, 40, 0.0, client="a")
    assert (exists.value.code, exists.value.header) == ("session_exists", "x-meshnet-session")
    with pytest.raises(CapacityError) as quota:  # the per-client quota counts it
        table.check_adopt("5b1e0c2a-2222-4abc-8def-000000000002", 0.0, client="a")
    assert quota.value.code == "client_sessions_full"
    # The next run starts at the imported position, under the bound key.
    chunk = WireHeaders(shape=(1, 1), dtype="int32", session=S, chunk_index=0, chunk_total=1,
                        position=40, session_key=FP)  # fmt: skip
    assert table.between_runs(S, 0.0) and not table.between_runs("nobody", 0.0)
    decision = table.offer(chunk, b"f" * 16, 0.0)
    assert decision.ticket.position == 40
    assert not table.between_runs(S, 0.0)  # a run open, its chunk in flight
    table.stage_done(decision.ticket, None, 0.0)
    table.response_ready(decision.ticket, b"answer", 0.0)
    assert table.between_runs(S, 0.0) and table.position(S) == 41
    with pytest.raises(Exception) as forbidden:
        table.offer(chunk.replace(session_key=None, position=41), b"g" * 16, 0.0)
    assert getattr(forbidden.value, "code", None) == "session_forbidden"


def test_the_gate_stays_closed_for_a_gateway_input_too() -> None:
    """require_sequencing=False (a gateway) parses the grammar; the server's
    marker check refuses KV headers on its /forward as on a node's."""
    array = kv()
    conn = ServerConnection(require_sequencing=False)
    conn.receive_data(request(kv_headers(array), array, target=b"/forward"))
    event = conn.next_event()
    assert isinstance(event, ProtocolErrorReceived) and event.error.code == "bad_kv"


@given(st.sampled_from(["kv=1", "a=b&kv=1", "kv=1&replay=1"]))
def test_the_marker_is_kv_equals_one_among_the_parameters(query: str) -> None:
    headers = kv_headers(kv())
    assert ActivationHead(headers=headers, expects_continue=False, query=query).kv_import
    assert not ActivationHead(headers=headers, expects_continue=False, query="kv=2").kv_import
