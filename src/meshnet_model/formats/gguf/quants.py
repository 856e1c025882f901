"""GGML tensor encodings → numpy arrays, for the types a GGUF stage may hold.

Each quantized type stores fixed-size blocks of bytes, one block per
``block`` consecutive values of a row (ggml's layout, little-endian):

* ``Q8_0`` (32 values, 34 bytes): float16 scale ``d``, 32 int8 ``q``; value ``q * d``.
* ``Q4_0`` (32 values, 18 bytes): ``d``, 16 bytes of nibbles — the low nibbles
  are values 0..15, the high ones 16..31; value ``d * (q - 8)``.
* ``Q4_1`` (32 values, 20 bytes): ``d``, a float16 offset ``m``, nibbles as
  Q4_0; value ``d * q + m``.
* ``Q4_K`` (256 values, 144 bytes): float16 ``d`` and ``dmin``, 12 bytes
  packing eight 6-bit scales and eight 6-bit mins, 128 bytes of nibbles
  (32 bytes per pair of 32-value sub-blocks: low nibbles first sub-block,
  high nibbles the second); value ``(d * scale) * q - dmin * min``.
* ``Q6_K`` (256 values, 210 bytes): 128 bytes of low nibbles, 64 bytes of
  2-bit high parts, 16 int8 scales (one per 16 values), float16 ``d``;
  value ``(d * scale) * (q - 32)`` with ``q`` 6 bits.

The arithmetic is float32 in the order of llama.cpp's reference (and of the
``gguf`` package's ``dequantize``), so the results are the same bits — the
tests check that for every type. ``F32``/``F16``/``BF16`` are not decoded at
all: they are returned as views of the file's bytes (``BF16`` as
``ml_dtypes.bfloat16``), so an unquantized stage stays memory-mapped.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np

__all__ = ["GGML_TYPES", "GGMLType", "decode"]

F32 = np.float32


class GGMLType:
    """One ggml tensor type: its id in the file, block size and block bytes."""

    def __init__(
        self,
        name: str,
        type_id: int,
        block: int,
        nbytes: int,
        view: np.dtype | None = None,
        dequantize: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        self.name = name
        self.type_id = type_id
        self.block = block
        self.nbytes = nbytes
        self.view = view  # a plain float type read in place
        self.dequantize = dequantize  # blocks [n, nbytes] uint8 -> [n, block] float32

    def row_bytes(self, columns: int) -> int:
        return columns // self.block * self.nbytes


def _half(raw: np.ndarray) -> np.ndarray:
    """Two bytes per block (columns of a [n, 2] uint8 array) → float32 [n, 1]."""
    return np.ascontiguousarray(raw).view(np.float16).astype(F32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, k] bytes → [n, 2k]: the k low nibbles, then the k high ones."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    d = _half(blocks[:, :2])
    q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(F32)
    values: np.ndarray = q * d
    return values


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    d = _half(blocks[:, :2])
    q = _nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
    return d * q.astype(F32)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    d = _half(blocks[:, :2])
    m = _half(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:]).astype(F32)
    values: np.ndarray = d * q + m
    return values


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes → eight 6-bit scales and eight 6-bit mins per block.

    Bytes 0..3 hold scales 0..3 in their low 6 bits, bytes 4..7 mins 0..3;
    scales/mins 4..7 take their low 4 bits from bytes 8..11 (low/high nibble)
    and their top 2 bits from the spare top bits of bytes 0..3 / 4..7.
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    low6, low4, two, four = np.uint8(0x3F), np.uint8(0x0F), np.uint8(6), np.uint8(4)
    scales = np.concatenate([a & low6, (c & low4) | ((a >> two) << four)], axis=1)
    mins = np.concatenate([b & low6, (c >> four) | ((b >> two) << four)], axis=1)
    return scales, mins


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d = _half(blocks[:, 0:2])
    dmin = _half(blocks[:, 2:4])
    scales, mins = _k_scales(blocks[:, 4:16])
    # 4 chunks of 32 bytes; chunk c is sub-blocks 2c (low nibbles) and 2c+1 (high).
    qs = blocks[:, 16:].reshape(n, 4, 32)
    q = np.stack([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=2).reshape(n, 8, 32).astype(F32)
    sub_d = (d * scales.astype(F32)).reshape(n, 8, 1)
    sub_m = (dmin * mins.astype(F32)).reshape(n, 8, 1)
    values: np.ndarray = (sub_d * q - sub_m).reshape(n, 256)
    return values


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 64)  # two halves of 128 values
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(F32)
    d = _half(blocks[:, 208:210])
    # Per half: values 0..63 are the low nibbles of its 64 bytes, 64..127 the high
    # ones; the 2-bit high parts of value 32*j + l sit at bits 2j of qh byte l.
    low = np.concatenate([ql & np.uint8(0x0F), ql >> np.uint8(4)], axis=-1).reshape(n, 2, 4, 32)
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    high = (qh >> shifts) & np.uint8(0x03)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    sub_d = (d * scales).reshape(n, 16, 1)
    values: np.ndarray = (sub_d * q.reshape(n, 16, 16).astype(F32)).reshape(n, 256)
    return values


GGML_TYPES: dict[int, GGMLType] = {
    t.type_id: t
    for t in (
        GGMLType("F32", 0, 1, 4, view=np.dtype("<f4")),
        GGMLType("F16", 1, 1, 2, view=np.dtype("<f2")),
        GGMLType("BF16", 30, 1, 2, view=np.dtype(ml_dtypes.bfloat16)),
        GGMLType("Q4_0", 2, 32, 18, dequantize=_q4_0),
        GGMLType("Q4_1", 3, 32, 20, dequantize=_q4_1),
        GGMLType("Q8_0", 8, 32, 34, dequantize=_q8_0),
        GGMLType("Q4_K", 12, 256, 144, dequantize=_q4_k),
        GGMLType("Q6_K", 14, 256, 210, dequantize=_q6_k),
    )
}


def decode(raw: np.ndarray, kind: GGMLType, shape: tuple[int, ...]) -> np.ndarray:
    """The values of a tensor of numpy ``shape`` from its bytes ``raw`` (uint8,
    exactly ``prod(shape[:-1]) * row_bytes(shape[-1])`` of them): a view for the
    float types, a new float32 array for the quantized ones."""
    flat = raw.reshape(-1)
    if kind.view is not None:
        return flat.view(kind.view).reshape(shape)
    assert kind.dequantize is not None
    blocks = flat.reshape(-1, kind.nbytes)
    return kind.dequantize(blocks).reshape(shape)
