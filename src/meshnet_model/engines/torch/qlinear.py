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
* ``Int8Matrix`` — every other quantized type (``Q8_0``, ``Q5_*``, ``Q6_K`` …):
  the dequantized rows requantized to int8 with one bfloat16 scale per row
  (``_weight_int8pack_mm``): a requantization, named ``int8-row`` wherever
  the stage describes itself. 1 byte a value.
* a dense tensor (``torch.nn.functional.linear``) for float matrices.

``linear(torch, x, weight, bias)`` multiplies by any of the three. Every
conversion runs a chunk of rows at a time (``_ROWS`` rows): no transient
copy of a whole tensor in a wider type is ever made, so the peak of a load
stays near what the stage holds after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...formats.gguf.blocks import GROUP, INT4_TYPES, dequantize_rows, int4_groups, row_chunks
from ...formats.gguf.quants import GGMLType

__all__ = ["HELD_FORMS", "Int4Matrix", "Int8Matrix", "held_form", "linear", "quantized_matrix"]

# Rows converted at once: a multiple of the int4pack kernel's 64-row tiles
# (its packing is independent between such blocks of rows, checked in tests).
_ROWS = 1024
HELD_FORMS = ("int4pack", "int8-row")


def held_form(kind: GGMLType) -> str:
    """The form a quantized GGML type is held in by this engine on the CPU."""
    return "int4pack" if kind.name in INT4_TYPES else "int8-row"


@dataclass(frozen=True, slots=True)
class Int4Matrix:
    """``[out, in]`` weights as int4pack nibbles and bfloat16 (scale, zero) per 32."""

    packed: Any  # uint8 [out, in // 2], the kernel's layout
    scale_zero: Any  # bfloat16 [in // 32, out, 2]
    shape: tuple[int, int]
    source: str  # the GGML type it came from

    form = "int4pack"

    @property
    def nbytes(self) -> int:
        return int(self.packed.numel() + self.scale_zero.numel() * self.scale_zero.element_size())

    def matmul(self, torch: Any, x: Any) -> Any:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.shape[1])
        if flat.dtype != self.scale_zero.dtype:
            flat = flat.to(self.scale_zero.dtype)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scale_zero)
        return out.reshape(*lead, self.shape[0])


@dataclass(frozen=True, slots=True)
class Int8Matrix:
    """``[out, in]`` weights as int8 with one bfloat16 scale per row."""

    values: Any  # int8 [out, in]
    scales: Any  # bfloat16 [out]
    shape: tuple[int, int]
    source: str

    form = "int8-row"

    @property
    def nbytes(self) -> int:
        return int(self.values.numel() + self.scales.numel() * self.scales.element_size())

    def matmul(self, torch: Any, x: Any) -> Any:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.shape[1])
        if flat.dtype != self.scales.dtype:
            flat = flat.to(self.scales.dtype)
        out = torch._weight_int8pack_mm(flat, self.values, self.scales)
        return out.reshape(*lead, self.shape[0])


def linear(torch: Any, x: Any, weight: Any, bias: Any = None) -> Any:
    """``x @ weight.T (+ bias)`` for a dense tensor or a quantized matrix."""
    if isinstance(weight, Int4Matrix | Int8Matrix):
        out = weight.matmul(torch, x)
        return out if bias is None else out + bias
    return torch.nn.functional.linear(x, weight, bias)


def int4pack_supported(shape: tuple[int, int]) -> bool:
    """The CPU kernel's constraints: rows in 64-row tiles, columns in 32-value groups
    that pack into whole 16-byte tiles."""
    rows, cols = shape
    return rows % 64 == 0 and cols % 64 == 0


def quantized_matrix(
    torch: Any, kind: GGMLType, shape: tuple[int, int], blocks: np.ndarray, *, compute: Any
) -> Int4Matrix | Int8Matrix:
    """The held form of one quantized matrix from its file bytes ``[rows, row_bytes]``.

    ``compute`` is the activations' dtype (bfloat16 on the CPU): the scales are
    held in it, as the kernels require.
    """
    rows, cols = shape
    if kind.name in INT4_TYPES and int4pack_supported(shape):
        packed = torch.empty((rows, cols // 2), dtype=torch.uint8)
        scale_zero = torch.empty((cols // GROUP, rows, 2), dtype=compute)
        for part in row_chunks(rows, _ROWS):
            q, scale, zero = int4_groups(blocks[part], kind)
            ints = torch.from_numpy(q).to(torch.int32)
            packed[part] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(ints, 1)
            pair = np.stack([scale, zero], axis=-1).transpose(1, 0, 2)  # [groups, rows, 2]
            scale_zero[:, part] = torch.from_numpy(np.ascontiguousarray(pair)).to(compute)
        return Int4Matrix(packed, scale_zero, shape, kind.name)
    values = torch.empty((rows, cols), dtype=torch.int8)
    scales = torch.empty((rows,), dtype=compute)
    for part in row_chunks(rows, _ROWS):
        dense = dequantize_rows(blocks[part], kind, cols)
        peak = np.abs(dense).max(axis=1)
        # The scale is rounded to the held dtype first, so that q * scale is
        # the value the kernel will use.
        step = torch.from_numpy(np.maximum(peak, np.float32(1e-30)) / np.float32(127))
        step = step.to(compute)
        q = np.rint(dense / step.float().numpy()[:, None])
        values[part] = torch.from_numpy(np.clip(q, -127, 127).astype(np.int8))
        scales[part] = step
    return Int8Matrix(values, scales, shape, kind.name)
