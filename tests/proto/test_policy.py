"""Wire dtype and encoding policies (wire-2 §5), through the public API."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_proto import (
    EncodingPolicy,
    ProtocolError,
    WireDtypePolicy,
    encode_for_wire,
    encode_tensor,
)
from meshnet_proto._policy import AUTO_MIN_BYTES, AUTO_MIN_SAVING, apply_wire_dtype, choose_encoding

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)


def u(array: np.ndarray) -> np.ndarray:
    return array.view(f"<u{array.dtype.itemsize}")


# ------------------------------------------------------------- auto-lossless


@pytest.mark.parametrize(
    ("values", "source", "expected"),
    [
        # Exact in bfloat16 (and in float16 too): a tie, bfloat16 wins.
        ([1.0, -2.0, 0.5, 0.0, -0.0, 3.0], F32, BF16),
        # Exact in bfloat16, not float16 (out of float16's range).
        ([2.0**100, -(2.0**-100)], F32, BF16),
        # Exact in float16 (10 mantissa bits), not bfloat16 (7).
        ([1.0 + 2.0**-10, 3.0], F32, F16),
        ([1.0 + 2.0**-10], F16, F16),
        # Generic floats: only float32 carries them.
        ([0.1, 1.0 / 3.0], F32, F32),
        # Non-finite values rule out the half formats.
        ([1.0, float("nan")], F32, F32),
        ([1.0, float("inf")], F32, F32),
        ([float("-inf")], F16, F32),
        ([float("nan")], BF16, F32),
        # Already bfloat16 and finite: stays (a tie with float16 at best).
        ([1.5, 3e38], BF16, BF16),
        # float16 exact in bfloat16 too: a tie, bfloat16 wins.
        ([0.5, 2.0], F16, BF16),
    ],
)
def test_auto_lossless_choice(values: list[float], source: np.dtype, expected: np.dtype) -> None:
    array = np.array(values, dtype=source)
    wire = apply_wire_dtype(array, WireDtypePolicy.AUTO_LOSSLESS)
    assert wire.dtype == expected
    if expected.itemsize >= source.itemsize:
        np.testing.assert_array_equal(u(array.astype(expected)), u(wire))
    else:
        np.testing.assert_array_equal(u(wire.astype(source)), u(array))


def test_auto_lossless_counts_negative_zero() -> None:
    # -0.0 survives both half formats, so it does not force float32 ...
    assert apply_wire_dtype(np.array([-0.0], F32), "auto-lossless").dtype == BF16
    # ... but a float16 subnormal that bfloat16 rounds away does not tie.
    tiny = np.array([2.0**-24], F16)
    assert apply_wire_dtype(tiny, "auto-lossless").dtype == BF16  # 2**-24 is a power of two
    odd = np.array([3 * 2.0**-24], F16)
    assert apply_wire_dtype(odd, "auto-lossless").dtype == BF16
    odder = np.array([1023 * 2.0**-24], F16)  # 10 significant bits
    assert apply_wire_dtype(odder, "auto-lossless").dtype == F16


def test_auto_lossless_returns_the_array_itself_when_it_keeps_the_dtype() -> None:
    array = np.array([0.1], F32)
    assert apply_wire_dtype(array, "auto-lossless") is array
    nan = np.array([np.nan], F32)
    assert apply_wire_dtype(nan, "auto-lossless") is nan


@settings(max_examples=100)
@given(st.lists(st.floats(width=32), min_size=1, max_size=20))
def test_auto_lossless_is_lossless_and_minimal(values: list[float]) -> None:
    array = np.array(values, dtype=F32)
    wire = apply_wire_dtype(array, "auto-lossless")
    np.testing.assert_array_equal(u(wire.astype(F32)), u(array))
    if wire.dtype == F32 and np.isfinite(array).all():
        # Neither half format would have carried it.
        for half in (BF16, F16):
            with np.errstate(over="ignore"):
                back = array.astype(half).astype(F32)
            assert not np.array_equal(u(back), u(array))


# ------------------------------------------------------------------ float16


def test_float16_is_round_to_nearest_even() -> None:
    # 1 + 2**-11 is exactly halfway between 1 and 1 + 2**-10: ties to even (1).
    # 1 + 3 * 2**-11 is halfway between 1 + 2**-10 and 1 + 2**-9: to even (1 + 2**-9).
    array = np.array([1 + 2.0**-11, 1 + 3 * 2.0**-11, 65504.0, 65519.0], F32)
    wire = apply_wire_dtype(array, WireDtypePolicy.FLOAT16)
    assert wire.dtype == F16
    assert wire.tolist() == [1.0, 1 + 2.0**-9, 65504.0, 65504.0]


@pytest.mark.parametrize(
    ("values", "bad_index", "shown"),
    [
        ([1.0, 65520.0], 1, "65520"),  # the first value that rounds to inf
        ([-1e5, 2.0], 0, "-100000"),
        ([0.0, 1.0, 3.4e38], 2, "3.4e+38"),
    ],
)
def test_float16_overflow_names_the_value_and_its_index(
    values: list[float], bad_index: int, shown: str
) -> None:
    array = np.array(values, F32).reshape(1, -1)
    with pytest.raises(ProtocolError) as info:
        apply_wire_dtype(array, WireDtypePolicy.FLOAT16)
    assert (info.value.status, info.value.code) == (400, "float16_overflow")
    assert shown in info.value.message
    assert f"flat index {bad_index}" in info.value.message


def test_float16_overflow_from_bfloat16() -> None:
    with pytest.raises(ProtocolError) as info:
        apply_wire_dtype(np.array([1.0, 7e4], BF16), "float16")
    assert info.value.code == "float16_overflow"
    assert "flat index 1" in info.value.message


def test_float16_carries_nan_and_inf() -> None:
    array = np.array([np.nan, np.inf, -np.inf, 1.0], F32)
    wire = apply_wire_dtype(array, "float16")
    assert np.isnan(wire[0]) and wire[1] == np.inf and wire[2] == -np.inf and wire[3] == 1


# ----------------------------------------------------------------- bfloat16


def test_bfloat16_is_round_to_nearest_even() -> None:
    # The upper half of the float32 bits, rounded to nearest even.
    words = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F808001], np.uint32)
    wire = apply_wire_dtype(words.view(F32), "bfloat16")
    assert u(wire).tolist() == [0x3F80, 0x3F82, 0x3F81, 0x3F81]


def test_bfloat16_carries_nan_and_inf_and_refuses_overflow() -> None:
    wire = apply_wire_dtype(np.array([np.nan, -np.inf, 3e38], F32), "bfloat16")
    assert np.isnan(wire[0].astype(F32)) and wire[1].astype(F32) == -np.inf
    with pytest.raises(ProtocolError) as info:
        apply_wire_dtype(np.array([3.4e38], F32), "bfloat16")
    assert (info.value.status, info.value.code) == (400, "bfloat16_overflow")
    assert "flat index 0" in info.value.message


def test_float16_to_bfloat16_and_back_to_float32() -> None:
    wire = apply_wire_dtype(np.array([1.0, 65504.0], F16), "bfloat16")
    assert wire.dtype == BF16
    widened = apply_wire_dtype(wire, "float32")
    assert widened.dtype == F32 and widened.tolist() == [1.0, 65536.0]


# -------------------------------------------------------------- keep / int32


@pytest.mark.parametrize("policy", list(WireDtypePolicy))
def test_int32_is_never_converted(policy: WireDtypePolicy) -> None:
    ids = np.array([1, 2, 2**31 - 1], np.int32)
    assert apply_wire_dtype(ids, policy) is ids


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_keep_and_same_dtype_return_the_array_itself(dtype: np.dtype) -> None:
    array = np.ones(3, dtype)
    assert apply_wire_dtype(array, "keep") is array
    assert apply_wire_dtype(array, str(WireDtypePolicy(dtype.name))) is array


def test_non_wire_dtypes_and_unknown_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="not a wire dtype"):
        apply_wire_dtype(np.ones(3), "float32")
    with pytest.raises(ValueError):
        apply_wire_dtype(np.ones(3, F32), "float64")


def test_policy_values_are_the_spec_tokens() -> None:
    assert [p.value for p in WireDtypePolicy] == [
        "keep",
        "float32",
        "bfloat16",
        "float16",
        "auto-lossless",
    ]
    assert [p.value for p in EncodingPolicy] == ["mirror", "identity", "zstd", "auto"]
    assert WireDtypePolicy("auto-lossless") == "auto-lossless"


# ---------------------------------------------------------------- encodings


@pytest.mark.parametrize(
    ("policy", "request_encoding", "expected"),
    [
        ("mirror", "identity", "identity"),
        ("mirror", "zstd", "zstd"),
        (EncodingPolicy.IDENTITY, "zstd", "identity"),
        (EncodingPolicy.ZSTD, "identity", "zstd"),
        (EncodingPolicy.AUTO, "identity", "auto"),
    ],
)
def test_choose_encoding(policy: str, request_encoding: str, expected: str) -> None:
    assert choose_encoding(policy, request_encoding=request_encoding) == expected


def test_choose_encoding_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        choose_encoding("mirror", request_encoding="gzip")
    with pytest.raises(ValueError):
        choose_encoding("brotli", request_encoding="identity")


def _activation(tokens: int, hidden: int = 1024) -> np.ndarray:
    rng = np.random.default_rng(7)
    return (rng.standard_normal((1, tokens, hidden)) * 0.5).astype(F32)


def test_auto_skips_small_bodies() -> None:
    small = np.zeros(AUTO_MIN_BYTES // 4 - 1, F32)  # very compressible, but small
    dtype, encoding, body = encode_for_wire(small, encoding_policy="auto")
    assert (dtype, encoding) == ("float32", "identity")
    assert isinstance(body, memoryview)


def test_auto_keeps_zstd_when_it_saves_enough() -> None:
    activation = _activation(16).astype(BF16)  # bfloat16 activations save ~20 %
    dtype, encoding, body = encode_for_wire(activation, encoding_policy="auto")
    assert (dtype, encoding) == ("bfloat16", "zstd")
    assert len(body) <= activation.nbytes * (1 - AUTO_MIN_SAVING)


def test_auto_drops_zstd_when_it_does_not_pay() -> None:
    noise = np.random.default_rng(3).integers(-(2**31), 2**31, 4096, dtype=np.int64)
    incompressible = noise.astype(np.int32)
    dtype, encoding, body = encode_for_wire(incompressible, encoding_policy="auto")
    assert (dtype, encoding) == ("int32", "identity")
    assert bytes(body) == incompressible.tobytes()


def test_encode_for_wire_applies_both_policies() -> None:
    activation = _activation(4)
    dtype, encoding, body = encode_for_wire(
        activation,
        dtype_policy="bfloat16",
        encoding_policy="mirror",
        request_encoding="zstd",
        level=3,
    )
    assert (dtype, encoding) == ("bfloat16", "zstd")
    assert isinstance(body, bytes)
    dtype, encoding, body = encode_for_wire(activation)
    assert (dtype, encoding) == ("float32", "identity")
    assert bytes(body) == bytes(encode_tensor(activation))
