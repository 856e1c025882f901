"""What a sender puts on the wire: dtype and encoding policies (wire-2 §5).

A node's output toward ``--next`` and the gateway's chunks follow these
policies; a receiver learns the outcome from ``X-Meshnet-Dtype`` and
``X-Meshnet-Encoding``. See docs/codecs.md for the reasoning and figures.

Conversions never lose range silently: a finite value that would become
infinite in float16 or bfloat16 raises an error naming it. NaN and ±inf are
representable in both half formats and are carried as they are under the
explicit ``float16``/``bfloat16`` policies; ``auto-lossless`` keeps them in
float32 (wire-2 §5: non-finite values rule out the half formats).
"""

from __future__ import annotations

import enum
from typing import Any

import ml_dtypes
import numpy as np
import zstandard

from ._codec import encode_tensor
from ._dtypes import WIRE_DTYPES, wire_dtype_name
from ._errors import ErrorCode, ProtocolError

__all__ = [
    "AUTO_MIN_BYTES",
    "AUTO_MIN_SAVING",
    "EncodingPolicy",
    "WireDtypePolicy",
    "apply_wire_dtype",
    "choose_encoding",
    "encode_for_wire",
]

# `auto` encoding (docs/codecs.md has the measurements behind both numbers):
# under 4 KiB the most zstd can save is a few hundred bytes — less than one
# TCP segment's worth — while setting up a compression context costs more than
# sending them; and a frame that saves under 10 % costs its receiver a
# decompression pass for almost no bandwidth.
AUTO_MIN_BYTES = 4096
AUTO_MIN_SAVING = 0.10

_FLOAT32 = WIRE_DTYPES["float32"]
_FLOAT16 = WIRE_DTYPES["float16"]
_BFLOAT16 = WIRE_DTYPES["bfloat16"]
_INT32 = WIRE_DTYPES["int32"]
# AUTO_LOSSLESS candidates, smallest first; bfloat16 before float16 so it wins
# a tie (wire-2 §5).
_AUTO_CANDIDATES = (_BFLOAT16, _FLOAT16, _FLOAT32)
# Unsigned views for bit-pattern comparison, by item size.
_BITS: dict[int, np.dtype[Any]] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


class WireDtypePolicy(enum.StrEnum):
    """Which dtype a sender puts on the wire (wire-2 §5)."""

    KEEP = "keep"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    AUTO_LOSSLESS = "auto-lossless"


class EncodingPolicy(enum.StrEnum):
    """Which body encoding a sender uses (wire-2 §5)."""

    MIRROR = "mirror"
    IDENTITY = "identity"
    ZSTD = "zstd"
    AUTO = "auto"


def _convert(array: np.ndarray, target: np.dtype) -> np.ndarray:
    # numpy's float32→float16 and ml_dtypes' casts are round-to-nearest-even;
    # overflow to inf is detected by the caller, so numpy's warning is noise.
    with np.errstate(over="ignore", invalid="ignore"):
        return array.astype(target)


def _isfinite(array: np.ndarray) -> np.ndarray:
    # ml_dtypes' isfinite warns "invalid value" on NaN, which is the answer
    # we asked for, not a problem.
    with np.errstate(invalid="ignore"):
        finite: np.ndarray = np.isfinite(array)  # numpy types a ufunc's result as Any
    return finite


def _narrow(array: np.ndarray, target: np.dtype, name: str) -> np.ndarray:
    """``array`` in ``target``, refusing any finite value that becomes infinite."""
    converted = _convert(array, target)
    overflow = np.isinf(converted) & _isfinite(array)
    if overflow.any():
        index = int(np.flatnonzero(overflow)[0])
        value = array.reshape(-1)[index]
        count = int(np.count_nonzero(overflow))
        # np.finfo knows no bfloat16; ml_dtypes ships its finfo unannotated.
        limit = float(ml_dtypes.finfo(target).max)  # type: ignore[no-untyped-call]
        raise ProtocolError(
            f"value {value!s} at flat index {index} does not fit {name} "
            f"(largest finite: {limit:g}; {count} such value(s)); use a wider wire dtype",
            code=ErrorCode[f"{name.upper()}_OVERFLOW"],
        )
    return converted


def _round_trips(array: np.ndarray, converted: np.ndarray) -> bool:
    back = _convert(converted, array.dtype)
    bits = _BITS[array.dtype.itemsize]
    return bool(np.array_equal(array.view(bits), back.view(bits)))


def _auto_lossless(array: np.ndarray) -> np.ndarray:
    if not _isfinite(array).all():
        return array if array.dtype == _FLOAT32 else _convert(array, _FLOAT32)
    for candidate in _AUTO_CANDIDATES:
        if candidate == array.dtype:
            # Reached only after every smaller or tied candidate failed (the
            # candidates are ordered, so nothing wider is ever tried).
            return array
        converted = _convert(array, candidate)
        if _round_trips(array, converted):
            return converted
    raise AssertionError("unreachable: the input's own dtype is a candidate")  # pragma: no cover


def apply_wire_dtype(array: np.ndarray, policy: WireDtypePolicy | str) -> np.ndarray:
    """``array`` in the wire dtype ``policy`` asks for.

    ``array`` must have a wire dtype (float32, float16, bfloat16, int32;
    ``ValueError`` otherwise). int32 tensors are returned unchanged by every
    policy (token ids are not floats). Returns ``array`` itself, not a copy,
    when no conversion is needed. float16 and bfloat16 conversions round to
    nearest even; a finite value whose rounding leaves the target's finite
    range raises ``ProtocolError`` ``float16_overflow`` (or
    ``bfloat16_overflow``, status 400) naming the value and its flat index.
    """
    policy = WireDtypePolicy(policy)
    name = wire_dtype_name(array.dtype)
    if name == "int32" or policy is WireDtypePolicy.KEEP:
        return array
    if policy is WireDtypePolicy.AUTO_LOSSLESS:
        return _auto_lossless(array)
    target = WIRE_DTYPES[policy.value]
    if array.dtype == target:
        return array
    if policy is WireDtypePolicy.FLOAT32:
        return _convert(array, target)  # float16 and bfloat16 widen exactly
    return _narrow(array, target, policy.value)


def choose_encoding(policy: EncodingPolicy | str, *, request_encoding: str) -> str:
    """``"identity"``, ``"zstd"`` or ``"auto"`` (decided per body by encode_for_wire).

    MIRROR answers in the encoding of the request being served, so a client
    that sent zstd gets zstd back.
    """
    policy = EncodingPolicy(policy)
    if policy is EncodingPolicy.MIRROR:
        if request_encoding not in ("identity", "zstd"):
            raise ValueError(f"request encoding must be identity or zstd, got {request_encoding!r}")
        return request_encoding
    return policy.value


def encode_for_wire(
    array: np.ndarray,
    *,
    dtype_policy: WireDtypePolicy | str = WireDtypePolicy.KEEP,
    encoding_policy: EncodingPolicy | str = EncodingPolicy.MIRROR,
    request_encoding: str = "identity",
    level: int = 1,
    compressor: zstandard.ZstdCompressor | None = None,
) -> tuple[str, str, bytes | memoryview]:
    """Apply both policies: ``(wire dtype name, encoding, body)``.

    ``auto`` compresses only bodies of at least ``AUTO_MIN_BYTES`` and keeps
    the frame only when it saves at least ``AUTO_MIN_SAVING`` of the size.
    ``compressor`` (one per thread) is passed through to ``encode_tensor``.
    """
    wire = apply_wire_dtype(array, dtype_policy)
    dtype_name = wire_dtype_name(wire.dtype)
    encoding = choose_encoding(encoding_policy, request_encoding=request_encoding)
    if encoding != "auto":
        return (
            dtype_name,
            encoding,
            encode_tensor(wire, encoding=encoding, level=level, compressor=compressor),
        )
    raw = encode_tensor(wire)
    if len(raw) < AUTO_MIN_BYTES:
        return dtype_name, "identity", raw
    frame = encode_tensor(wire, encoding="zstd", level=level, compressor=compressor)
    if len(frame) <= len(raw) * (1 - AUTO_MIN_SAVING):
        return dtype_name, "zstd", frame
    return dtype_name, "identity", raw
