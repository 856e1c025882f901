"""Quantized matrices for the torch engine: held in (a repacking of) their GGUF
blocks, multiplied by kernels that read them.

The kernels were chosen by measurement (docs/models.md, "Quantized compute"):

* ``Int4Matrix`` — ``Q4_0``, ``Q4_1``, ``Q4_K``: torch's int4pack layout
  (``_convert_weight_to_int4pack_for_cpu``) with one bfloat16 (scale, zero)
  pair per 32 values, multiplied by ``_weight_int4pack_mm_for_cpu``. The
  nibbles are the file's own; the (scale, zero) pairs are exact maps of the
  block's scales (``formats.gguf.blocks.int4_groups``) rounded to bfloat16, and the
  activations are bfloat16: those two roundings are what this form loses.
  0.625 bytes a value (the file's Q4_0 holds 0.5625).
  ``Q8_0`` is held as two such matrices whose sum is exactly its values (its
  high and low nibbles, ``int4_split``): 1.25 bytes a value, two kernel
  calls, no requantization. (torch's ``_weight_int8pack_mm`` takes one scale
  per *row*; requantizing Q8_0's per-32 scales to it cost 8x the KL on the
  real model's head, measured — so it is not used.)
* a dense bfloat16 tensor (``torch.nn.functional.linear``) for the types no
  kernel here reads (``Q6_K``: its scales are per 16 values, int4pack's
  groups are 32 or more) and for shapes the kernel refuses (rows not in
  64-row tiles): dequantized a chunk of rows at a time, 2 bytes a value —
  named ``bfloat16`` in the stage's held forms.

A prompt chunk's whole tiles of 64 positions may instead take the dense
GEMM on tiles of the weights decoded to bfloat16 (``dense_tiles``, chosen per
stage at load: ``calibrate``): ``layers.product`` hands ``Int4Matrix.matmul``
the step's ``StepRows``.

``linear(torch, x, weight, bias)`` multiplies by any of the three. Every
conversion runs a chunk of rows at a time (``_ROWS`` rows): no transient
copy of a whole tensor in a wider type is ever made, so the peak of a load
stays near what the stage holds after it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...formats.gguf.blocks import GROUP, INT4_FORMS, int4_split, row_chunks
from ...formats.gguf.quants import GGMLType
from .dense_tiles import StepRows

__all__ = [
    "KERNEL_DTYPE",
    "Int4Matrix",
    "stacks",
    "pack_int4",
    "held_form",
    "held_matrix_bytes",
    "int4pack_block",
    "int4pack_supported",
    "linear",
    "quantized_matrix",
]

# Rows converted at once: a multiple of the int4pack kernel's 64-row tiles
# (its packing is independent between such blocks of rows, checked in tests).
_ROWS = 1024


def held_form(kind: GGMLType, shape: tuple[int, int]) -> str:
    """The form this engine holds a quantized matrix of ``kind`` in on the CPU:
    ``int4pack`` (one or two), or ``dense`` (dequantized to the compute dtype)."""
    if kind.name in INT4_FORMS and int4pack_supported(shape):
        return "int4pack" if INT4_FORMS[kind.name] == 1 else f"int4pack x{INT4_FORMS[kind.name]}"
    return "dense"


def stacks(kinds: list[GGMLType], shape: tuple[int, int]) -> bool:
    """Whether matrices of these types, stacked by rows into ``shape``, are held as
    one quantized matrix (q/k/v, gate/up: one kernel call instead of three or
    two) — the loader and the footprint both ask this."""
    return len({k.name for k in kinds}) == 1 and held_form(kinds[0], shape) != "dense"


# The kernels' activation dtype on the CPU, in which they hold (scale, zero) too.
KERNEL_DTYPE = "bfloat16"


@dataclass(frozen=True, slots=True)
class Int4Matrix:
    """``[out, in]`` weights as one or two int4pack matrices, each with bfloat16
    (scale, zero) per 32 values; the weights are their sum (two for ``Q8_0``:
    its high and low nibbles, see ``int4_split``)."""

    parts: tuple[tuple[Any, Any], ...]  # (uint8 [out, in // 2] packed, bf16 [in // 32, out, 2])
    shape: tuple[int, int]
    source: str  # the GGML type it came from

    @property
    def form(self) -> str:
        return "int4pack" if len(self.parts) == 1 else f"int4pack x{len(self.parts)}"

    @property
    def nbytes(self) -> int:
        return sum(int(p.numel() + sz.numel() * sz.element_size()) for p, sz in self.parts)

    def matmul(self, torch: Any, x: Any, rows: Any = None) -> Any:
        """``x @ W.T`` in ``x``'s dtype; ``rows``: the step's ``StepRows``, whose
        dense tiles (if any) take the dense GEMM."""
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.shape[1])
        if flat.dtype != self.parts[0][1].dtype:
            flat = flat.to(self.parts[0][1].dtype)
        if isinstance(rows, StepRows) and rows.tiles:
            out = rows.kernel.matmul(
                torch,
                flat,
                self.parts,
                rows.tiles,
                int4pack=lambda some: self._int4pack(torch, some),
            )
            return out.reshape(*lead, self.shape[0]).to(x.dtype)
        return self._int4pack(torch, flat).reshape(*lead, self.shape[0]).to(x.dtype)

    def _int4pack(self, torch: Any, flat: Any) -> Any:
        """Rows ``flat`` (the kernels' dtype) by the int4pack kernel, each on its own."""
        packed, scale_zero = self.parts[0]
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        out = mm(flat, packed, GROUP, scale_zero)
        if len(self.parts) > 1:
            # Summed in float32: the two halves of a Q8_0 weight are of very
            # different sizes, and the sum must not round twice in bfloat16.
            out = out.float()
            for packed, scale_zero in self.parts[1:]:
                out += mm(flat, packed, GROUP, scale_zero)
        return out


def linear(torch: Any, x: Any, weight: Any, bias: Any = None, rows: Any = None) -> Any:
    """``x @ weight.T (+ bias)`` for a dense tensor or a quantized matrix
    (``rows``: the step's ``StepRows``, for a quantized one's dense tiles)."""
    if isinstance(weight, Int4Matrix):
        out = weight.matmul(torch, x, rows)
        return out if bias is None else out + bias
    if weight.dtype != x.dtype:
        # A matrix no kernel reads, held dequantized in the kernels' dtype
        # around a float32 stream (``held_form`` "dense").
        out = torch.nn.functional.linear(x.to(weight.dtype), weight).to(x.dtype)
        return out if bias is None else out + bias
    return torch.nn.functional.linear(x, weight, bias)


def held_matrix_bytes(kind: GGMLType, shape: tuple[int, int]) -> int:
    """Bytes a quantized matrix of ``kind`` and ``shape`` is held in on the CPU
    (what ``quantized_matrix`` builds, or its bfloat16 dense fallback)."""
    rows, cols = shape
    form = held_form(kind, shape)
    if form == "dense":
        return 2 * rows * cols
    one = rows * cols // 2 + (cols // GROUP) * rows * 4  # nibbles + bf16 (scale, zero)
    return one * INT4_FORMS[kind.name]


def int4pack_supported(shape: tuple[int, int]) -> bool:
    """The CPU kernel's constraints: rows in 64-row tiles, columns in 32-value groups
    that pack into whole 16-byte tiles."""
    rows, cols = shape
    return rows % 64 == 0 and cols % 64 == 0


def quantized_matrix(
    torch: Any, kind: GGMLType, shape: tuple[int, int], blocks: np.ndarray, *, compute: Any
) -> Int4Matrix | None:
    """The held form of one quantized matrix from its file bytes ``[rows, row_bytes]``,
    or None when no kernel here reads its type (the caller dequantizes it then).

    ``compute`` is the kernels' activation dtype (bfloat16 on the CPU): the
    (scale, zero) pairs are held in it, as the kernels require.
    """
    rows, cols = shape
    if held_form(kind, shape) == "dense":
        return None
    count = INT4_FORMS[kind.name]
    block = int4pack_block(torch)
    # Filled a chunk of rows at a time: the nibbles in numpy (handed to torch
    # without a copy), the (scale, zero) pairs converted to ``compute`` chunk by
    # chunk, so no float32 copy of a whole tensor's pairs is made either.
    packed = [np.empty((rows, cols // 2), np.uint8) for _ in range(count)]
    pairs = [torch.empty((cols // GROUP, rows, 2), dtype=compute) for _ in range(count)]
    for part in row_chunks(rows, _ROWS):
        for i, (q, scale, zero) in enumerate(int4_split(blocks[part], kind)):
            packed[i][part] = _torch_pack(torch, q) if block is None else pack_int4(q, block)
            pair = np.stack([scale.T, zero.T], axis=-1)  # [groups, chunk rows, 2]
            pairs[i][:, part] = torch.from_numpy(pair).to(compute)
    parts = tuple(
        (torch.from_numpy(nibbles), pair) for nibbles, pair in zip(packed, pairs, strict=True)
    )
    return Int4Matrix(parts, shape, kind.name)


def _torch_pack(torch: Any, q: np.ndarray) -> np.ndarray:
    ints = torch.from_numpy(q).to(torch.int32)
    packed: np.ndarray = torch.ops.aten._convert_weight_to_int4pack_for_cpu(ints, 1).numpy()
    return packed


def pack_int4(q: np.ndarray, block: int = 64) -> np.ndarray:
    """Nibbles ``q`` uint8 ``[rows, cols]`` (rows in 64-row tiles) in the CPU
    kernel's layout, by byte shuffles: each block of ``block`` rows is
    ``[cols / 2, 2, block / 2]`` bytes, the byte at ``(c // 2, c % 2, r %
    (block / 2))`` holding row ``r``'s value ``c`` in its low nibble (the
    block's first half of rows) or high one. torch picks the block by the
    CPU's vector width: 64 rows on AVX-512, 32 on AVX2 (``int4pack_block``).
    torch's own converter computes the same from int32 inputs, 5x slower
    (measured: 43 ms against 223 ms for an 8192 x 2048 matrix)."""
    rows, cols = q.shape
    half = block // 2
    tiles = q.reshape(rows // block, 2, half, cols)
    byte = tiles[:, 0] | (tiles[:, 1] << np.uint8(4))  # [blocks, half, cols]
    shuffled = byte.reshape(rows // block, half, cols // 2, 2).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(shuffled).reshape(rows, cols // 2)


@functools.cache
def int4pack_block(torch: Any) -> int | None:
    """The rows of this torch's int4pack block on this CPU (the layout
    ``pack_int4`` writes and ``dense_tiles`` reads), or None when neither
    known layout is its own (then its converter packs, and no dense tile is
    used): checked once per process on a random matrix."""
    q = np.random.default_rng(0).integers(0, 16, (128, 256)).astype(np.uint8)
    theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.from_numpy(q.astype(np.int32)), 1
    ).numpy()
    return next((b for b in (64, 32) if np.array_equal(pack_int4(q, b), theirs)), None)
