"""Reading a Hugging Face checkpoint directory's tensors, memory-mapped.

A directory holds ``model.safetensors``, or shards ``model-0000k-of-0000n.safetensors``
listed by ``model.safetensors.index.json`` (``weight_map``: tensor name → file).
A stage reads only the tensors it runs; with the index, only the shard files
that hold them are opened.

Tensors are read as numpy views on a read-only ``np.memmap`` of the file: no
copy, and pages are loaded by the OS only when touched. The byte layout is
taken from the file's own header (8-byte little-endian length, then a JSON
table of ``dtype``/``shape``/``data_offsets``), every entry checked against
the file size first. ``safetensors.safe_open`` gives the same values but
copies each tensor into memory, and numpy itself has no bfloat16 — here
``BF16`` is viewed as ``ml_dtypes.bfloat16``. ``mmap=False`` reads through
``safe_open`` instead (the tests compare both).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import CheckpointError
from ..progress import NO_PROGRESS, LoadProgress
from .reading import read_rows

__all__ = ["Checkpoint", "CheckpointError", "SafetensorsFile"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
# A header larger than this is not a checkpoint we trust to parse (safetensors' own cap).
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class _Entry:
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """One ``.safetensors`` file: its table of tensors and memory-mapped reads."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with self.path.open("rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise CheckpointError(f"{self.path}: shorter than a safetensors header")
                (header_len,) = struct.unpack("<Q", prefix)
                if header_len > min(_MAX_HEADER, size - 8):
                    raise CheckpointError(f"{self.path}: header length {header_len} is invalid")
                header = json.loads(f.read(header_len))
        except OSError as exc:
            raise CheckpointError(f"{self.path}: {exc.strerror or exc}") from None
        except ValueError as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{self.path}: header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + header_len
        data_size = size - self._data_start
        self._entries: dict[str, _Entry] = {}
        for name, info in header.items():
            self._entries[name] = self._entry(name, info, data_size)
        self._map: np.memmap | None = None

    def _entry(self, name: str, info: object, data_size: int) -> _Entry:
        try:
            assert isinstance(info, dict)
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (AssertionError, KeyError, TypeError, ValueError):
            raise CheckpointError(f"{self.path}: tensor {name!r} has a bad table entry") from None
        if any(d < 0 for d in shape):
            raise CheckpointError(f"{self.path}: tensor {name!r} has a negative dimension")
        expected = math.prod(shape) * dtype.itemsize
        if not 0 <= begin <= end <= data_size or end - begin != expected:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} ({info['dtype']} {list(shape)}) does not fit "
                f"its data_offsets [{begin}, {end}) in {data_size} data bytes"
            )
        return _Entry(dtype, shape, begin, end)

    def keys(self) -> list[str]:
        return list(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def dtype(self, name: str) -> np.dtype:
        return self._entries[name].dtype

    def span(self, name: str) -> tuple[int, int]:
        """The tensor's bytes in the file: absolute offset and length."""
        entry = self._entries[name]
        return self._data_start + entry.begin, entry.end - entry.begin

    def read(self, name: str) -> np.ndarray:
        """The tensor *read* into memory of this process's own (``pread``), not
        mapped: for a loader that converts it and drops it, so that no page of
        the file stays counted in the stage's RSS."""
        entry = self._entries[name]
        raw = read_rows(self.path, self._data_start + entry.begin, 1, entry.end - entry.begin)
        return raw.reshape(-1).view(entry.dtype).reshape(entry.shape)

    def tensor(self, name: str, *, mmap: bool = True) -> np.ndarray:
        """The tensor, read-only: a view on the file's mapping, or (``mmap=False``)
        a copy read through ``safetensors.safe_open``."""
        entry = self._entries[name]
        if not mmap:
            from safetensors import safe_open

            with safe_open(str(self.path), framework="numpy") as f:
                array = np.asarray(f.get_tensor(name))
            array.flags.writeable = False
            return array
        if entry.end == entry.begin:
            return np.zeros(entry.shape, entry.dtype)
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._map[self._data_start + entry.begin : self._data_start + entry.end]
        # A plain ndarray view (the mapping stays alive through .base): results
        # computed from it are ndarrays, not np.memmap instances.
        return np.asarray(raw).view(entry.dtype).reshape(entry.shape)


class Checkpoint:
    """A Hugging Face checkpoint directory's safetensors, by tensor name."""

    def __init__(self, directory: str | Path, *, progress: LoadProgress = NO_PROGRESS) -> None:
        """``progress``: told the stored bytes of each tensor when it is first read."""
        self.directory = Path(directory)
        self.progress = progress
        self._counted: set[str] = set()
        index = self.directory / INDEX_FILE
        single = self.directory / SINGLE_FILE
        self.weight_map: dict[str, str]
        if index.exists():
            try:
                raw = json.loads(index.read_text(encoding="utf-8"))
                weight_map = raw["weight_map"]
                assert isinstance(weight_map, dict)
            except (ValueError, KeyError, TypeError, AssertionError):
                raise CheckpointError(f"{index}: not a safetensors index (weight_map)") from None
            for name, file in weight_map.items():
                if not isinstance(file, str) or Path(file).name != file:
                    raise CheckpointError(f"{index}: {name!r} maps to a bad file name {file!r}")
            self.weight_map = dict(weight_map)
            self.sharded = True
        elif single.exists():
            self.weight_map = dict.fromkeys(SafetensorsFile(single).keys(), SINGLE_FILE)
            self.sharded = False
        else:
            raise CheckpointError(
                f"{self.directory}: neither {SINGLE_FILE} nor {INDEX_FILE} is there"
            )
        self._files: dict[str, SafetensorsFile] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.weight_map

    def file_for(self, name: str) -> SafetensorsFile:
        try:
            file = self.weight_map[name]
        except KeyError:
            raise CheckpointError(
                f"{self.directory}: the checkpoint has no tensor {name!r}"
            ) from None
        opened = self._files.get(file)
        if opened is None:
            opened = self._files[file] = SafetensorsFile(self.directory / file)
        if name not in opened:
            raise CheckpointError(
                f"{self.directory / file}: has no tensor {name!r} (the index says so)"
            )
        return opened

    def tensor(self, name: str, *, mmap: bool = True) -> np.ndarray:
        array = self.file_for(name).tensor(name, mmap=mmap)
        self._count(name)
        return array

    def read(self, name: str) -> np.ndarray:
        """The tensor read, not mapped (``SafetensorsFile.read``)."""
        array = self.file_for(name).read(name)
        self._count(name)
        return array

    def _count(self, name: str) -> None:
        # Once per tensor: a tied head reads the embedding a second time.
        if name not in self._counted:
            self._counted.add(name)
            self.progress.on_bytes(self.file_for(name).span(name)[1])

    def files_opened(self) -> list[str]:
        """Shard files this checkpoint has opened so far (a stage opens only its own)."""
        return sorted(self._files)

    def dtypes(self, names: Iterable[str]) -> set[str]:
        return {self.file_for(n).dtype(n).name for n in names}
