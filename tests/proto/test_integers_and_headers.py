"""The strict integer grammar and the wire-2 §2 header set, through the public API."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_proto import Limits, MeshnetError, ProtocolError, WireHeaders
from meshnet_proto._dtypes import WIRE_DTYPES, wire_dtype_name
from meshnet_proto._headers import parse_wire_headers
from meshnet_proto._integers import parse_canonical_uint

SESSION = "5b1e7c2a-0d4f-4e8b-9a1c-3f6e2d7b8c90"


def pairs(**overrides: bytes | str | None) -> list[tuple[bytes, bytes | str]]:
    """A valid node request's headers, with some replaced or (None) removed."""
    base: dict[str, bytes | str | None] = {
        "content-type": b"application/octet-stream",
        "x-meshnet-shape": b"1,4,8",
        "x-meshnet-dtype": b"float32",
        "x-meshnet-session": SESSION.encode(),
        "x-meshnet-chunk-index": b"0",
        "x-meshnet-chunk-total": b"1",
    }
    for key, value in overrides.items():
        base[key.replace("_", "-")] = value
    return [(name.encode(), value) for name, value in base.items() if value is not None]


# ---------------------------------------------------------------- integers


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("0", 0),
        (b"0", 0),
        ("7", 7),
        (b"10", 10),
        ("9" * 19, 10**19 - 1),
        (bytearray(b"42"), 42),
        (memoryview(b"123"), 123),
    ],
)
def test_canonical_uint_accepts(raw: bytes | str, expected: int) -> None:
    assert parse_canonical_uint(raw, header="x-meshnet-position") == expected


@pytest.mark.parametrize(
    "raw",
    [
        "",
        b"",
        "00",
        "01",
        "-1",
        "+1",
        " 1",
        "1 ",
        "1_000",
        "٤",  # ARABIC-INDIC DIGIT FOUR: int() and isdigit() accept it
        "\uff11",  # FULLWIDTH DIGIT ONE
        "1\n",
        "0x10",
        "1e3",
        "1.0",
        "1" * 20,
        "9" * 10_000,
        b"\xff",
        "\ud800",  # a lone surrogate must not become a UnicodeError
    ],
)
def test_canonical_uint_rejects(raw: bytes | str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_canonical_uint(raw, header="X-Meshnet-Position")
    assert (info.value.status, info.value.code, info.value.header) == (
        400,
        "bad_integer",
        "x-meshnet-position",
    )


def test_canonical_uint_rejects_other_types() -> None:
    with pytest.raises(TypeError):
        parse_canonical_uint(7, header="x")  # type: ignore[arg-type]


@given(st.integers(min_value=0, max_value=10**19 - 1))
def test_canonical_uint_round_trips(value: int) -> None:
    assert parse_canonical_uint(str(value), header="x") == value


# ------------------------------------------------------------------ dtypes


def test_wire_dtypes_are_little_endian() -> None:
    assert set(WIRE_DTYPES) == {"float32", "float16", "bfloat16", "int32"}
    for name, dtype in WIRE_DTYPES.items():
        assert dtype.byteorder in ("<", "=") if dtype.itemsize > 1 else True
        assert wire_dtype_name(dtype) == name
    assert WIRE_DTYPES["bfloat16"] == np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize(
    ("dtype", "name"),
    [(">f4", "float32"), ("<f2", "float16"), (">i4", "int32"), (ml_dtypes.bfloat16, "bfloat16")],
)
def test_wire_dtype_name_ignores_byte_order(dtype: object, name: str) -> None:
    assert wire_dtype_name(np.dtype(dtype)) == name
    # Also as what np.dtype() accepts (a scalar type, a string): the long way.
    assert wire_dtype_name(dtype) == name  # type: ignore[arg-type]


def test_wire_dtype_name_finds_an_equal_dtype_by_lookup() -> None:
    # Native order and metadata do not make another dtype: still the token.
    assert wire_dtype_name(np.dtype("=f2")) == "float16"
    assert wire_dtype_name(np.dtype("f4", metadata={"from": "a test"})) == "float32"
    assert wire_dtype_name(np.float32) == "float32"


@pytest.mark.parametrize("dtype", ["f8", "i8", "i1", "u4", "bool", "V2", "c8"])
def test_wire_dtype_name_rejects_others(dtype: str) -> None:
    with pytest.raises(ValueError, match="not a wire dtype"):
        wire_dtype_name(np.dtype(dtype))


# ----------------------------------------------------------------- parsing


def test_parse_minimal_node_request() -> None:
    headers = parse_wire_headers(pairs())
    assert headers == WireHeaders(
        shape=(1, 4, 8), dtype="float32", session=SESSION, chunk_index=0, chunk_total=1
    )
    assert headers.encoding == "identity"
    assert headers.nbytes == 128
    assert headers.tokens == 4
    assert headers.numpy_dtype == np.dtype("<f4")


def test_parse_every_field_any_case_str_or_bytes() -> None:
    given_pairs: list[tuple[bytes | str, bytes | str]] = [
        ("Content-Type", " Application/Octet-Stream\t"),
        (b"X-MESHNET-WIRE", b"2"),
        ("x-Meshnet-Shape", "2,3"),
        (b"X-Meshnet-Dtype", "bfloat16"),
        ("X-Meshnet-Session", SESSION),
        ("X-Meshnet-Chunk-Index", b"2"),
        ("X-Meshnet-Chunk-Total", "3"),
        ("X-Meshnet-Encoding", "zstd"),
        ("X-Meshnet-Position", "1024"),
        ("X-Meshnet-Deadline-Ms", "59000"),
        ("X-Meshnet-Stage", "stub-echo/0"),
        ("Content-Length", "12"),
        ("X-Meshnet-Future-Thing", "whatever"),
        ("X-Meshnet-Future-Thing", "twice is fine: unknown"),
    ]
    headers = parse_wire_headers(given_pairs)
    assert headers == WireHeaders(
        shape=(2, 3),
        dtype="bfloat16",
        session=SESSION,
        chunk_index=2,
        chunk_total=3,
        encoding="zstd",
        position=1024,
        deadline_ms=59000,
        stage="stub-echo/0",
    )
    assert headers.tokens == 3
    assert headers.nbytes == 12


def test_kelvin_sign_does_not_spell_a_known_header() -> None:
    # str.lower() maps U+212A KELVIN SIGN to "k"; header names must not.
    sneaky = [*pairs(x_meshnet_chunk_index=None), ("x-meshnet-chun\u212a-index", "0")]
    with pytest.raises(ProtocolError) as info:
        parse_wire_headers(sneaky)
    assert info.value.code == "missing_header"
    assert info.value.header == "x-meshnet-chunk-index"


def test_gateway_input_without_sequencing() -> None:
    minimal = pairs(x_meshnet_session=None, x_meshnet_chunk_index=None, x_meshnet_chunk_total=None)
    headers = parse_wire_headers(minimal, require_sequencing=False)
    assert (headers.session, headers.chunk_index, headers.chunk_total) == (None, None, None)
    full = parse_wire_headers(pairs(), require_sequencing=False)
    assert (full.session, full.chunk_index, full.chunk_total) == (SESSION, 0, 1)
    index_only = pairs(x_meshnet_chunk_total=None)
    assert parse_wire_headers(index_only, require_sequencing=False).chunk_index == 0


def test_limits_are_honoured() -> None:
    small = Limits(max_rank=2, max_tensor_bytes=64, max_chunk_total=4)
    with pytest.raises(ProtocolError) as info:
        parse_wire_headers(pairs(), limits=small)
    assert info.value.code == "bad_shape"
    with pytest.raises(ProtocolError) as info:
        parse_wire_headers(pairs(x_meshnet_shape="4,5"), limits=small)
    assert (info.value.status, info.value.code) == (413, "tensor_too_large")
    assert parse_wire_headers(pairs(x_meshnet_shape="4,4"), limits=small).nbytes == 64
    ok = pairs(x_meshnet_shape="4,4", x_meshnet_chunk_total="4", x_meshnet_chunk_index="3")
    assert parse_wire_headers(ok, limits=small).chunk_total == 4


def test_huge_shape_is_rejected_before_anything_is_allocated() -> None:
    # 8 dimensions of 19 digits: computed exactly with Python ints.
    with pytest.raises(ProtocolError) as info:
        parse_wire_headers(pairs(x_meshnet_shape=",".join(["9" * 19] * 8)))
    assert (info.value.status, info.value.code) == (413, "tensor_too_large")


def test_header_errors_carry_a_message_and_serialise() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_wire_headers(pairs(x_meshnet_dtype="float64"))
    body = info.value.to_dict()["error"]
    assert body["status"] == 415
    assert body["code"] == "unsupported_dtype"
    assert body["header"] == "x-meshnet-dtype"
    assert "float64" in body["message"]


def test_wire1_message_says_wire_1_is_gone() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_wire_headers(pairs(content_type="application/json"))
    assert "wire 1 is gone" in info.value.message


def test_long_values_are_quoted_briefly() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_wire_headers(pairs(content_type="x" * 10_000))
    assert len(info.value.message) < 300


def test_rejects_non_bytes_pairs() -> None:
    with pytest.raises(TypeError):
        parse_wire_headers([(b"content-type", 5)])  # type: ignore[list-item]


# ------------------------------------------------------------- WireHeaders


def test_to_pairs_is_canonical_and_parses_back() -> None:
    headers = WireHeaders(
        shape=(1, 128, 16384),
        dtype="bfloat16",
        session=SESSION,
        chunk_index=3,
        chunk_total=9,
        encoding="zstd",
        position=384,
        deadline_ms=1500,
        stage="0123456789abcdef0123456789abcdef/14",
    )
    out = headers.to_pairs()
    assert out == [
        (b"Content-Type", b"application/octet-stream"),
        (b"X-Meshnet-Wire", b"2"),
        (b"X-Meshnet-Shape", b"1,128,16384"),
        (b"X-Meshnet-Dtype", b"bfloat16"),
        (b"X-Meshnet-Session", SESSION.encode()),
        (b"X-Meshnet-Chunk-Index", b"3"),
        (b"X-Meshnet-Chunk-Total", b"9"),
        (b"X-Meshnet-Encoding", b"zstd"),
        (b"X-Meshnet-Position", b"384"),
        (b"X-Meshnet-Deadline-Ms", b"1500"),
        (b"X-Meshnet-Stage", b"0123456789abcdef0123456789abcdef/14"),
    ]
    assert not any(name.lower() == b"content-length" for name, _ in out)
    assert parse_wire_headers(out) == headers


def test_to_pairs_omits_unset_fields() -> None:
    names = [name for name, _ in WireHeaders(shape=(3,), dtype="int32").to_pairs()]
    assert names == [
        b"Content-Type",
        b"X-Meshnet-Wire",
        b"X-Meshnet-Shape",
        b"X-Meshnet-Dtype",
        b"X-Meshnet-Encoding",
    ]


uuids = st.uuids().map(str)
uints = st.integers(min_value=0, max_value=10**19 - 1)
stages = st.builds(
    lambda model, layer: f"{model}/{layer}",
    st.from_regex(r"[a-z0-9][a-z0-9._-]{0,63}", fullmatch=True),
    uints,
)


@st.composite
def wire_headers(draw: st.DrawFn) -> WireHeaders:
    shape = tuple(draw(st.lists(st.integers(1, 10**6), min_size=1, max_size=8)))
    total = draw(st.none() | st.integers(1, 65536))
    index = None if total is None else draw(st.none() | st.integers(0, total - 1))
    return WireHeaders(
        shape=shape,
        dtype=draw(st.sampled_from(sorted(WIRE_DTYPES))),
        session=draw(st.none() | uuids),
        chunk_index=index,
        chunk_total=total,
        encoding=draw(st.sampled_from(["identity", "zstd"])),
        position=draw(st.none() | uints),
        deadline_ms=draw(st.none() | uints),
        stage=draw(st.none() | stages),
    )


@settings(max_examples=150)
@given(wire_headers())
def test_to_pairs_round_trips(headers: WireHeaders) -> None:
    limits = Limits(max_tensor_bytes=10**200)
    if headers.chunk_total in (None, 1) and headers.chunk_index in (None, 0):
        parsed = parse_wire_headers(headers.to_pairs(), limits=limits, require_sequencing=False)
        assert parsed == headers
    if None not in (headers.session, headers.chunk_index, headers.chunk_total):
        assert parse_wire_headers(headers.to_pairs(), limits=limits) == headers


def test_parsed_round_trip_rejects_gateway_only_chunks() -> None:
    headers = WireHeaders(shape=(1, 2), dtype="float32", chunk_index=1, chunk_total=2)
    with pytest.raises(ProtocolError) as info:
        parse_wire_headers(headers.to_pairs(), require_sequencing=False)
    assert info.value.code == "bad_chunk_index"


def test_for_array_and_properties() -> None:
    array = np.zeros((2, 5, 3), dtype=">f4")
    headers = WireHeaders.for_array(array, session=SESSION, chunk_index=0, chunk_total=1)
    assert headers.shape == (2, 5, 3)
    assert headers.dtype == "float32"
    assert headers.tokens == 5
    assert headers.nbytes == 120
    rank1 = WireHeaders.for_array(np.zeros(7, dtype=ml_dtypes.bfloat16))
    assert (rank1.dtype, rank1.tokens, rank1.nbytes) == ("bfloat16", 7, 14)
    with pytest.raises(ValueError, match="not a wire dtype"):
        WireHeaders.for_array(np.zeros(3))


def test_replace_validates() -> None:
    headers = WireHeaders(shape=(1, 4), dtype="float32", chunk_index=0, chunk_total=2)
    assert headers.replace(chunk_index=1).chunk_index == 1
    with pytest.raises(ValueError):
        headers.replace(chunk_index=2)
    with pytest.raises(ValueError):
        headers.replace(dtype="float64")


# Values for replace(), valid and not: each field's own grammar, its
# relations (index < total), and normalisation (a list shape, numpy ints).
_REPLACEMENTS: dict[str, list[object]] = {
    "shape": [(1, 4), [2, 3], (np.int64(5),), (), (0, 1), (True,), "1,2", (np.int64(1), 4), [1, 4]],
    "dtype": ["float32", "bfloat16", "float64", 7],
    "encoding": ["identity", "zstd", "gzip"],
    "session": [None, SESSION, SESSION.upper(), "x"],
    "chunk_index": [None, 0, 1, 2, -1, True, np.int64(1)],
    "chunk_total": [None, 1, 2, 0, 10**19],
    "position": [None, 0, 9, -3, 1.5],
    "deadline_ms": [None, 0, 250, "250"],
    "stage": [None, "smollm2/0", "Bad/x"],
    "session_key": [None, "0" * 32, "0" * 31],
    "prefix": [None, "0" * 32, "zz"],
    "prefix_blocks": [(), ("0" * 32,), ["0" * 32], ("x",)],
    "kv_checksum": [None, "0" * 16, "0" * 15],
    "kv_fingerprint": [None, "0" * 32, "0"],
}


def _outcome(build: object) -> object:
    try:
        return build()  # type: ignore[operator]
    except (ValueError, TypeError) as exc:
        return type(exc)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(sorted(_REPLACEMENTS)), st.integers(min_value=0, max_value=6), max_size=5
    )
)
def test_replace_is_building_anew(picks: dict[str, int]) -> None:
    """replace() checks only what changed (the rest was checked when the
    instance was built): it must still answer exactly as building the
    changed instance from scratch does, value or error."""
    base = WireHeaders(
        shape=(1, 4), dtype="float32", session=SESSION, chunk_index=0, chunk_total=2, position=3
    )
    changes = {
        name: _REPLACEMENTS[name][pick % len(_REPLACEMENTS[name])] for name, pick in picks.items()
    }
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(WireHeaders)}
    expected = _outcome(lambda: WireHeaders(**{**fields, **changes}))  # type: ignore[arg-type]
    got = _outcome(lambda: base.replace(**changes))
    assert got == expected
    if isinstance(got, WireHeaders):
        assert all(type(dim) is int for dim in got.shape)


def test_replace_without_a_change_is_the_instance_itself() -> None:
    """A decode step's answer usually repeats the request's fields: no copy
    then. A value equal to the field's but of other types is a change, and
    normalised or refused like one."""
    base = WireHeaders(shape=(1, 4), dtype="float32", position=3)
    same = base.replace(shape=(1, 4), dtype="float32", position=3, stage=None, prefix_blocks=())
    assert same is base
    # An equal shape that is another tuple object (a literal would be the
    # same constant): compared element by element, and still no change.
    assert base.replace(shape=tuple([1, 4])) is base
    # So is an equal str or int that is another object (one parsed anew).
    assert base.replace(dtype="".join(["float", "32"])) is base
    far = WireHeaders(shape=(1, 4), dtype="float32", position=10**6)
    assert far.replace(position=int("1000000")) is far
    numpy_shape = base.replace(shape=(np.int64(1), 4))
    assert numpy_shape is not base and numpy_shape == base
    assert all(type(dim) is int for dim in numpy_shape.shape)
    assert base.replace(shape=[1, 4]) == base and base.replace(shape=[1, 4]) is not base
    with pytest.raises(ValueError):
        WireHeaders(shape=(1, 4), dtype="float32", position=True)
    with pytest.raises(ValueError):
        base.replace(position=True)


def test_replace_keeps_a_subclass_and_its_own_fields() -> None:
    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class Tagged(WireHeaders):
        tag: str = "a"

    tagged = Tagged(shape=(1, 2), dtype="float32", tag="b").replace(position=4)
    assert type(tagged) is Tagged and (tagged.tag, tagged.position) == ("b", 4)
    with pytest.raises(ValueError):
        tagged.replace(dtype="float64")


def test_replace_refuses_an_unknown_field() -> None:
    headers = WireHeaders(shape=(1,), dtype="int32")
    with pytest.raises(TypeError, match="no field 'colour'"):
        headers.replace(colour="red")


def test_headers_are_frozen_and_slotted() -> None:
    headers = WireHeaders(shape=(1,), dtype="int32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        headers.dtype = "float32"  # type: ignore[misc]
    assert not hasattr(headers, "__dict__")
    with pytest.raises(TypeError):
        WireHeaders((1,), "int32")  # type: ignore[misc]  # keyword-only


def test_shape_is_normalised_to_a_tuple_of_ints() -> None:
    headers = WireHeaders(shape=[np.int64(2), 3], dtype="float16")  # type: ignore[arg-type]
    assert headers.shape == (2, 3)
    assert all(type(dim) is int for dim in headers.shape)


@pytest.mark.parametrize(
    "fields",
    [
        {"shape": ()},
        {"shape": (1,) * 9},
        {"shape": (0, 3)},
        {"shape": (10**19,)},
        {"shape": (True, 2)},
        {"shape": (1.5, 2)},
        {"shape": 3},
        {"shape": ("1",)},
        {"dtype": "float64"},
        {"dtype": "Float32"},
        {"encoding": "gzip"},
        {"session": SESSION.upper()},
        {"session": "{" + SESSION + "}"},
        {"session": "é" * 36},
        {"session": 5},
        {"chunk_index": -1, "chunk_total": 1},
        {"chunk_index": 1, "chunk_total": 1},
        {"chunk_total": 0},
        {"chunk_index": True},
        {"position": -1},
        {"position": 10**19},
        {"deadline_ms": 1.0},
        {"stage": "Model/0"},
        {"stage": "m/01"},
        {"stage": "é/0"},
        {"stage": 5},
    ],
)
def test_hand_built_headers_validate(fields: dict[str, object]) -> None:
    values: dict[str, object] = {"shape": (1, 2), "dtype": "float32", **fields}
    with pytest.raises(ValueError):
        WireHeaders(**values)  # type: ignore[arg-type]


# ------------------------------------------------------------ the property

_KNOWN_NAMES = [
    "content-type",
    "x-meshnet-wire",
    "x-meshnet-shape",
    "x-meshnet-dtype",
    "x-meshnet-session",
    "x-meshnet-chunk-index",
    "x-meshnet-chunk-total",
    "x-meshnet-encoding",
    "x-meshnet-position",
    "x-meshnet-deadline-ms",
    "x-meshnet-stage",
]
_PLAUSIBLE_VALUES = [
    "application/octet-stream",
    "application/json",
    "2",
    "1,4,8",
    "1,0",
    "9999999999999999999,9999999999999999999",
    "float32",
    "bfloat16",
    "Float32",
    "float64",
    "zstd",
    "gzip",
    SESSION,
    "0",
    "1",
    "65537",
    "٤",
    "stub-echo/0",
    "stub-echo/",
]


def _recase(name: str, flips: list[bool]) -> str:
    return "".join(
        c.upper() if flip else c for c, flip in zip(name, flips + [False] * len(name), strict=False)
    )


header_names = st.one_of(
    st.builds(_recase, st.sampled_from(_KNOWN_NAMES), st.lists(st.booleans(), max_size=24)),
    st.text(max_size=24),
    st.binary(max_size=24),
)
header_values = st.one_of(
    st.sampled_from(_PLAUSIBLE_VALUES),
    st.text(max_size=48),
    st.binary(max_size=48),
    st.lists(st.integers(0, 10**20), min_size=0, max_size=10).map(
        lambda dims: ",".join(map(str, dims))
    ),
)


@settings(max_examples=400)
@given(
    st.lists(st.tuples(header_names, header_values), max_size=14),
    st.booleans(),
)
def test_parse_either_returns_headers_or_raises_meshnet_error(
    given_pairs: list[tuple[bytes | str, bytes | str]], require_sequencing: bool
) -> None:
    try:
        result = parse_wire_headers(given_pairs, require_sequencing=require_sequencing)
    except MeshnetError as error:
        assert 400 <= error.status < 500
        assert error.code
        assert error.message
    else:
        assert isinstance(result, WireHeaders)


@settings(max_examples=300)
@given(st.data())
def test_mutating_one_valid_header_never_escapes(data: st.DataObject) -> None:
    base = pairs(x_meshnet_encoding="zstd", x_meshnet_position="5", x_meshnet_deadline_ms="9")
    index = data.draw(st.integers(0, len(base) - 1))
    name, _ = base[index]
    base[index] = (name, data.draw(header_values))
    try:
        result = parse_wire_headers(base)
    except MeshnetError as error:
        assert error.header == name.decode()
    else:
        assert isinstance(result, WireHeaders)


# ------------------------------------------------------- X-Meshnet-Stage


@pytest.mark.parametrize(
    "value",
    [
        "stub-echo/0",
        "a/9999999999999999999",
        "0" * 64 + "/12",
        "m.v2_x-y/3",
    ],
)
def test_stage_accepts(value: str) -> None:
    assert parse_wire_headers(pairs(x_meshnet_stage=value)).stage == value


@pytest.mark.parametrize(
    "value",
    [
        "",
        "/0",
        "stub-echo",
        "stub-echo/",
        "Stub-echo/0",
        "-stub/0",
        ".stub/0",
        "stub echo/0",
        "stub/echo/0",
        "stub/-1",
        "stub/01",
        "stub/+1",
        "stub/10000000000000000000",
        "stub/\u0664",
        "a" * 65 + "/0",
        "stub/0\n",
    ],
)
def test_stage_rejects(value: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_wire_headers(pairs(x_meshnet_stage=value))
    assert (info.value.status, info.value.code, info.value.header) == (
        400,
        "bad_stage",
        "x-meshnet-stage",
    )


def test_stage_is_checked_after_the_deadline_and_duplicates_are_refused() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_wire_headers(pairs(x_meshnet_deadline_ms="01", x_meshnet_stage="bad"))
    assert info.value.header == "x-meshnet-deadline-ms"
    twice = [*pairs(x_meshnet_stage="m/0"), (b"X-Meshnet-Stage", b"m/0")]
    with pytest.raises(ProtocolError) as info:
        parse_wire_headers(twice)
    assert (info.value.code, info.value.header) == ("duplicate_header", "x-meshnet-stage")


@pytest.mark.parametrize(
    ("chunk_index", "position", "starts"),
    [
        (None, None, True),
        (0, None, True),
        (None, 0, True),
        (0, 0, True),
        (1, None, False),
        (0, 4, False),
        (None, 4, False),
        (2, 8, False),
    ],
)
def test_starts_session_is_a_first_chunk_with_nothing_before_it(
    chunk_index: int | None, position: int | None, starts: bool
) -> None:
    total = None if chunk_index is None else chunk_index + 1
    built = WireHeaders(
        shape=(1, 4, 8),
        dtype="float32",
        chunk_index=chunk_index,
        chunk_total=total,
        position=position,
    )
    assert built.starts_session is starts
    # The parser's headers say the same.
    overrides: dict[str, bytes | None] = {
        "x_meshnet_chunk_index": None if chunk_index is None else str(chunk_index).encode(),
        "x_meshnet_chunk_total": None if total is None else str(total).encode(),
        "x_meshnet_position": None if position is None else str(position).encode(),
    }
    parsed = parse_wire_headers(pairs(**overrides), require_sequencing=chunk_index is not None)
    assert parsed.starts_session is starts


# ---------------------------------------------------------------- parse memo


def test_a_shape_parsed_before_answers_as_when_first_parsed() -> None:
    """Shapes are remembered by their bytes (a session repeats its own): the
    answer is the same, and a tighter rank limit still refuses one it
    remembers."""
    from meshnet_proto import _header_values

    first = parse_wire_headers(pairs(x_meshnet_shape=b"2,3,5,7"))
    assert b"2,3,5,7" in _header_values._SHAPES
    again = parse_wire_headers(pairs(x_meshnet_shape=b"2,3,5,7"))
    assert again.shape == first.shape == (2, 3, 5, 7)
    with pytest.raises(ProtocolError) as refused:
        parse_wire_headers(pairs(x_meshnet_shape=b"2,3,5,7"), limits=Limits(max_rank=3))
    assert (refused.value.status, refused.value.code) == (400, "bad_shape")


def test_the_shape_memo_stays_small_whatever_a_peer_sends() -> None:
    from meshnet_proto import _header_values

    for dim in range(1, 3 * _header_values._MEMO_ENTRIES):
        parse_wire_headers(pairs(x_meshnet_shape=b"1,%d" % dim))
        assert len(_header_values._SHAPES) <= _header_values._MEMO_ENTRIES
    long_value = b",".join([b"100000000"] * 8)  # a valid shape, over the memo's length
    assert len(long_value) > _header_values._MEMO_VALUE_BYTES
    with pytest.raises(ProtocolError) as too_large:  # the size is checked after the grammar
        parse_wire_headers(pairs(x_meshnet_shape=long_value))
    assert too_large.value.code == "tensor_too_large"
    assert long_value not in _header_values._SHAPES
    with pytest.raises(ProtocolError):  # an invalid one is never remembered
        parse_wire_headers(pairs(x_meshnet_shape=b"1,0"))
    assert b"1,0" not in _header_values._SHAPES


@pytest.mark.parametrize(
    ("header", "value", "status", "code"),
    [
        ("x_meshnet_dtype", b"zstd", 415, "unsupported_dtype"),  # a known token, not a dtype
        ("x_meshnet_encoding", b"float32", 415, "unsupported_encoding"),
        ("x_meshnet_dtype", b"Float32", 400, "bad_dtype"),
    ],
)
def test_a_known_token_in_the_wrong_header_is_still_refused(
    header: str, value: bytes, status: int, code: str
) -> None:
    with pytest.raises(ProtocolError) as refused:
        parse_wire_headers(pairs(**{header: value}))
    assert (refused.value.status, refused.value.code) == (status, code)
