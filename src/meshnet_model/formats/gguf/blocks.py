"""GGML blocks re-expressed for the kernels that compute on them, row chunk by row chunk.

A quantized tensor is never widened whole: its rows are taken a chunk at a
time, straight from the file's bytes (``formats.reading``), and turned into the
form a kernel reads.

* ``int4_groups`` — the 4-bit types whose value is an affine map of a nibble
  per group of 32 values (``Q4_0``, ``Q4_1``, ``Q4_K``): the nibbles ``q``
  (0..15) and, per group, ``scale`` and ``zero`` such that the value is
  ``(q - 8) * scale + zero`` — the convention of torch's int4pack kernels.
  The map is exact in real arithmetic:

  - ``Q4_0``: ``d * (q - 8)`` → ``scale = d``, ``zero = 0``;
  - ``Q4_1``: ``d * q + m`` → ``scale = d``, ``zero = m + 8 d``;
  - ``Q4_K``: ``(d * sc) * q - dmin * mn`` per 32-value sub-block →
    ``scale = d * sc``, ``zero = 8 scale - dmin * mn``.

  Where the kernel holds ``scale``/``zero`` in bfloat16 (it does on the CPU)
  they are rounded: that rounding is the held form's named loss
  (docs/models.md, "Quantized compute").
* ``dequantize_rows`` — float32 values of some rows (``quants.decode``,
  the bit-exact reference), for the types no 4-bit kernel reads and for
  embedding lookups.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .quants import GGMLType, _half, _k_scales, _nibbles, decode

__all__ = [
    "INT4_FORMS",
    "INT4_TYPES",
    "dequantize_rows",
    "int4_groups",
    "int4_split",
    "row_chunks",
]

F32 = np.float32
# Types whose values are (q - 8) * scale + zero per 32-value group.
INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
GROUP = 32
# How many 4-bit affine matrices sum to a tensor of each type, exactly.
INT4_FORMS = {"Q4_0": 1, "Q4_1": 1, "Q4_K": 1, "Q8_0": 2}


def row_chunks(rows: int, chunk: int) -> Iterator[slice]:
    for start in range(0, rows, chunk):
        yield slice(start, min(start + chunk, rows))


def int4_groups(blocks: np.ndarray, kind: GGMLType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``blocks`` uint8 ``[rows, row_bytes]`` of a ``Q4_0``/``Q4_1``/``Q4_K`` tensor →
    ``(q, scale, zero)``: nibbles uint8 ``[rows, cols]`` in column order, and
    float32 ``[rows, cols // 32]`` with value ``(q - 8) * scale + zero``."""
    rows = blocks.shape[0]
    b = blocks.reshape(-1, kind.nbytes)
    n = b.shape[0]
    low, four = np.uint8(0x0F), np.uint8(4)
    if kind.name in ("Q4_0", "Q4_1"):
        d = _half(b[:, 0:2])
        qs = b[:, 2:] if kind.name == "Q4_0" else b[:, 4:]
        q = _nibbles(qs)  # values 0..15, then 16..31
        scale = d
        zero = np.zeros_like(d) if kind.name == "Q4_0" else _half(b[:, 2:4]) + F32(8) * d
        return (q.reshape(rows, -1), scale.reshape(rows, -1), zero.reshape(rows, -1))
    if kind.name == "Q4_K":
        d = _half(b[:, 0:2])
        dmin = _half(b[:, 2:4])
        scales, mins = _k_scales(b[:, 4:16])
        qs = b[:, 16:].reshape(n, 4, 32)
        q = np.stack([qs & low, qs >> four], axis=2).reshape(n, 256)
        scale = d * scales.astype(F32)  # [n, 8]
        zero = F32(8) * scale - dmin * mins.astype(F32)
        return (q.reshape(rows, -1), scale.reshape(rows, -1), zero.reshape(rows, -1))
    raise ValueError(f"{kind.name} is not a 4-bit affine type ({', '.join(sorted(INT4_TYPES))})")


def int4_split(
    blocks: np.ndarray, kind: GGMLType
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``blocks`` of a type in ``INT4_FORMS`` → 4-bit affine matrices (as
    ``int4_groups``) whose sum is the tensor, exactly in real arithmetic.

    ``Q8_0``'s ``d * q`` (``q`` int8) splits by nibbles: with ``u = q + 128``
    (0..255), ``hi = u >> 4`` and ``lo = u & 15``, ``d q = 16 d (hi - 8) + d lo``:
    a matrix of scale ``16 d``, zero 0, and one of scale ``d``, zero ``8 d``.
    """
    if kind.name != "Q8_0":
        return [int4_groups(blocks, kind)]
    rows = blocks.shape[0]
    b = blocks.reshape(-1, kind.nbytes)
    d = _half(b[:, 0:2])
    u = (np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    hi, lo = u >> np.uint8(4), u & np.uint8(0x0F)
    zero = np.zeros_like(d)
    return [
        (hi.reshape(rows, -1), (F32(16) * d).reshape(rows, -1), zero.reshape(rows, -1)),
        (lo.reshape(rows, -1), d.reshape(rows, -1), (F32(8) * d).reshape(rows, -1)),
    ]


def dequantize_rows(blocks: np.ndarray, kind: GGMLType, cols: int) -> np.ndarray:
    """float32 ``[rows, cols]`` of ``blocks`` uint8 ``[rows, row_bytes]``: the
    reference dequantization (bit-exact with llama.cpp's), or a float type widened."""
    values = decode(np.ascontiguousarray(blocks).reshape(-1), kind, (blocks.shape[0], cols))
    return values if values.dtype == F32 else values.astype(F32)
