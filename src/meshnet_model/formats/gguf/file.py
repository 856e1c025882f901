"""Parsing a GGUF file's header with the ``gguf`` package's reader.

``GGUFFile(path)`` memory-maps the file and builds only views: nothing of a
tensor is read until ``array(name)`` asks for it, and then only its bytes are
decoded (``quants.py``). Any failure to parse (bad magic, truncated
header or data, an unknown tensor type id) becomes one ``CheckpointError``
line; a tensor type we do not decode is refused, with its name, when read.
"""

from __future__ import annotations

import functools
import math
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import CheckpointError
from ..reading import RowReader
from .quants import GGML_TYPES, GGMLType, decode

__all__ = ["GGUFFile"]

_STRING, _ARRAY = 8, 9  # GGUFValueType ids
# Float32 bytes decoded at once: bounds the transients of decoding a big tensor.
_DECODE_CHUNK_BYTES = 32 * 1024 * 1024


def _field_value(field: Any) -> Any:
    """A ``ReaderField``'s value as plain Python (str, int, float, bool, list)."""
    from gguf import GGUFValueType

    types = field.types
    if not types:
        return None
    kind = types[-1] if types[0] != GGUFValueType.ARRAY or len(types) > 1 else GGUFValueType.UINT8
    values: list[Any]  # str, int, float or bool, by the field's type
    if kind == GGUFValueType.STRING:
        values = [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
    else:
        # One part per element, or (numeric arrays, see _Reader) one part for all.
        values = [v for i in field.data for v in field.parts[i].tolist()]
        if kind == GGUFValueType.BOOL:
            values = [bool(v) for v in values]
    return values if types[0] == GGUFValueType.ARRAY else values[0]


def _reader_class() -> type:
    """``GGUFReader``, made fast on real vocabularies.

    The package's reader slices its ``np.memmap`` once or twice per array
    element, and every ``np.memmap`` slice pays the subclass's bookkeeping: a
    Qwen-sized vocabulary (151k tokens and merges) took 36 s to parse here.
    Two changes, no change of result: the mapping is sliced as a plain
    ``ndarray`` view (which still holds the map alive), and a numeric array
    is one view, a string array one walk over its lengths (36 s → under 1 s).
    """
    from gguf import GGUFReader, GGUFValueType

    class _Reader(GGUFReader):
        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = np.asarray(value)

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if int(raw_type) != _ARRAY or self.byte_order != "I" or sys.byteorder != "little":
                return super()._get_field_parts(orig_offs, raw_type)
            item_type = self._get(orig_offs, np.uint32)
            count = self._get(orig_offs + 4, np.uint64)
            sub, n = int(item_type[0]), int(count[0])
            types = [GGUFValueType.ARRAY, GGUFValueType(sub)]
            nptype = self.gguf_scalar_to_np.get(GGUFValueType(sub))
            if nptype is not None:
                values = self._get(orig_offs + 12, nptype, n)
                if values.shape[0] != n:
                    raise ValueError(f"array at {orig_offs} runs past the end of the file")
                return 12 + int(values.nbytes), [item_type, count, values], [2], types
            if sub != _STRING:
                return super()._get_field_parts(orig_offs, raw_type)
            # Strings: a u64 length, then the bytes; walked without numpy per item.
            data = self._plain
            view = data.data  # memoryview(data); numpy types ndarray a Buffer only on 3.12+
            parts: list[np.ndarray] = [item_type, count]
            offs = orig_offs + 12
            for _ in range(n):
                (length,) = struct.unpack_from("<Q", view, offs)
                if offs + 8 + length > data.shape[0]:
                    raise ValueError(f"string at {offs} runs past the end of the file")
                parts.append(data[offs + 8 : offs + 8 + length])
                offs += 8 + length
            return offs - orig_offs, parts, list(range(2, len(parts))), types

    return _Reader


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=2)
def _open_reader(path: str, size: int, mtime_ns: int) -> Any:
    """The parsed header, kept: a node and a gateway read the config, the
    tensors and the tokenizer of one file, and parsing a real vocabulary takes
    seconds. Keyed by size and mtime, so a rewritten file is parsed again."""
    del size, mtime_ns  # part of the cache key only
    return _reader_class()(path, "r")


class GGUFFile:
    """A parsed GGUF header and memory-mapped tensor data."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file")
        try:
            self._reader = _open_reader(str(self.path.resolve()), *_stamp(self.path))
        except Exception as exc:  # the reader raises whatever numpy raises on bad bytes
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CheckpointError(
                f"{self.path}: not a readable GGUF file ({type(exc).__name__}: {detail})"
            ) from None
        self._values: dict[str, Any] = {}
        self.tensors = {t.name: t for t in self._reader.tensors}

    def keys(self) -> list[str]:
        return list(self._reader.fields)

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self._values:
            field = self._reader.fields.get(key)
            if field is None:
                return default
            self._values[key] = _field_value(field)
        return self._values[key]

    def field_span(self, key: str) -> tuple[int, int] | None:
        """The metadata record of ``key`` in the file (its key, type and value,
        as written): absolute offset and length; None when absent. Its parts
        are views of the reader's mapping in file order: the last one ends it."""
        field = self._reader.fields.get(key)
        if field is None:
            return None
        base = self._reader.data.__array_interface__["data"][0]
        last = field.parts[-1]
        end = last.__array_interface__["data"][0] - base + last.nbytes
        return int(field.offset), int(end - field.offset)

    @property
    def architecture(self) -> str:
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(f"{self.path}: no general.architecture in the metadata")
        return arch

    def type_of(self, name: str) -> GGMLType:
        tensor = self.tensors[name]
        kind = GGML_TYPES.get(int(tensor.tensor_type))
        if kind is None:
            supported = ", ".join(t.name for t in GGML_TYPES.values())
            raise CheckpointError(
                f"{self.path}: tensor {name} is {tensor.tensor_type.name}, a type this "
                f"package does not decode (supported: {supported})"
            )
        return kind

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy order: ``[rows, columns]`` (GGUF lists the dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def _checked(self, name: str) -> tuple[GGMLType, tuple[int, ...], Any]:
        """The tensor's type, numpy shape and reader entry, its byte count checked."""
        kind = self.type_of(name)
        shape = self.shape(name)
        if shape and shape[-1] % kind.block:
            raise CheckpointError(
                f"{self.path}: tensor {name} has rows of {shape[-1]}, not a multiple of "
                f"the {kind.name} block of {kind.block}"
            )
        tensor = self.tensors[name]
        expected = math.prod(shape[:-1]) * kind.row_bytes(shape[-1]) if shape else 0
        if tensor.data.nbytes != expected:
            raise CheckpointError(
                f"{self.path}: tensor {name} has {tensor.data.nbytes} bytes in the file, "
                f"{kind.name} {list(shape)} needs {expected} (truncated?)"
            )
        return kind, shape, tensor

    def array(self, name: str) -> np.ndarray:
        """The tensor's values: a view of the file for F32/F16/BF16, else float32
        (decoded a row chunk at a time into the result: no transient copies of
        the whole tensor beside it)."""
        kind, shape, tensor = self._checked(name)
        raw = np.asarray(tensor.data).view(np.uint8)
        if kind.view is not None or len(shape) < 2:
            return decode(raw, kind, shape)
        rows = raw.reshape(-1, kind.row_bytes(shape[-1]))
        out = np.empty((rows.shape[0], shape[-1]), np.float32)
        step = max(1, _DECODE_CHUNK_BYTES // max(1, 4 * shape[-1]))
        for start in range(0, rows.shape[0], step):
            part = rows[start : start + step]
            out[start : start + step] = decode(part, kind, (part.shape[0], shape[-1]))
        return out.reshape(shape)

    def mapped_rows(self, name: str) -> np.ndarray:
        """The tensor's bytes as ``[rows, row_bytes]`` uint8, a view of the mapping."""
        kind, shape, tensor = self._checked(name)
        cols = shape[-1] if shape else 1
        return np.asarray(tensor.data).view(np.uint8).reshape(-1, kind.row_bytes(cols))

    def rows(self, name: str) -> tuple[GGMLType, tuple[int, ...], RowReader]:
        """The tensor's type, numpy shape and stored rows, ``[rows, row_bytes]``
        uint8 *read* from the file (not mapped) a range at a time when sliced —
        for kernels that hold another form of them."""
        kind, shape, tensor = self._checked(name)
        cols = shape[-1] if shape else 1
        rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
        return (
            kind,
            shape,
            RowReader(self.path, int(tensor.data_offset), rows, kind.row_bytes(cols)),
        )

    def raw(self, name: str) -> tuple[GGMLType, tuple[int, ...], np.ndarray]:
        """As ``rows``, every row read at once."""
        kind, shape, reader = self.rows(name)
        return kind, shape, reader.all()
