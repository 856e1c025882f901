"""One stage's held weights in one file: written once, memory-mapped later.

The file is what ``weight_cache`` keeps (its docstring says when it is used).
Layout:

* ``MAGIC`` (8 bytes), the header's length (8 bytes, little-endian), the
  header: JSON;
* the data, from ``data_offset`` (a page boundary): every tensor's bytes as
  held in memory (the key names the machine type), each at an offset from
  ``data_offset`` aligned to 64 bytes, zeros between.

The header holds the key the file was written under (``weight_cache``), the
stage's slots (which tensor, or which int4pack parts, each field of each
layer is; a tied head names the slot it shares), the tensors (dtype, shape,
offset, bytes) and an xxh3-128 digest of the header's other fields and of
the data. A reader trusts nothing it has not checked: the file's owner and
mode, the magic, the key, the file's size, every tensor's span, the digest.
Any mismatch is ``StaleWeights`` (the caller rebuilds and writes the file
again), never a stage built from it.

A read maps the file copy-on-write (``MAP_PRIVATE``): the tensors are views
of its pages, loaded when first touched and shared with the page cache (and
with any other process mapping the same file); nothing is written through.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from .qlinear import Int4Matrix
from .weights import MappedEmbedding, TorchLayer, TorchStageWeights

__all__ = ["MAGIC", "StaleWeights", "read_header", "read_weights", "write_weights"]

MAGIC = b"MESHNETW"
_PAGE = 4096
_ALIGN = 64
_MAX_HEADER = 16 * 1024 * 1024
# dtype name -> bytes per element; the only dtypes a held stage has.
_ITEMSIZE = {"uint8": 1, "bfloat16": 2, "float16": 2, "float32": 4}
_WRITE = 8 * 1024 * 1024  # bytes handed to one write


class StaleWeights(Exception):
    """The file cannot be used for this stage (the message says why)."""


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _slots(weights: TorchStageWeights) -> Iterator[tuple[str, Any]]:
    yield "embed", weights.embed
    yield "norm", weights.norm
    yield "lm_head", weights.lm_head
    for i, block in enumerate(weights.blocks):
        for f in fields(block):
            yield f"blocks.{i}.{f.name}", getattr(block, f.name)


def _layout(weights: TorchStageWeights) -> tuple[list[dict[str, Any]], list[Any]]:
    """The header's slots and the tensors they name, each tensor once."""
    slots: list[dict[str, Any]] = []
    tensors: list[Any] = []
    index: dict[int, int] = {}
    named: dict[int, str] = {}

    def tensor(t: Any) -> int:
        if id(t) not in index:
            index[id(t)] = len(tensors)
            tensors.append(t)
        return index[id(t)]

    for name, value in _slots(weights):
        if value is None:
            continue
        if id(value) in named:  # a tied head: the embedding's own object
            slots.append({"slot": name, "same": named[id(value)]})
        elif isinstance(value, MappedEmbedding):
            slots.append({"slot": name, "mapped": True})
        elif isinstance(value, Int4Matrix):
            parts = [[tensor(p), tensor(sz)] for p, sz in value.parts]
            slots.append(
                {"slot": name, "int4": parts, "shape": list(value.shape), "source": value.source}
            )
        else:
            slots.append({"slot": name, "tensor": tensor(value)})
        named[id(value)] = name
    return slots, tensors


def _bytes(torch: Any, t: Any) -> np.ndarray:
    """A held tensor's bytes (a view, no copy: held tensors are contiguous)."""
    held: np.ndarray = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return held


def _pieces(
    torch: Any, header: dict[str, Any], tensors: list[Any], stopping: Callable[[], bool]
) -> Iterator[memoryview]:
    """The data's bytes in order: zeros up to each tensor, then its bytes."""
    at = 0
    for entry, t in zip(header["tensors"], tensors, strict=True):
        if stopping():
            raise InterruptedError("the process is exiting")
        if entry["offset"] > at:
            yield memoryview(bytes(entry["offset"] - at))
        data = _bytes(torch, t).data.cast("B")  # a Buffer to mypy (ndarray is one on 3.12+)
        for start in range(0, len(data), _WRITE):
            yield data[start : start + _WRITE]
        at = entry["offset"] + entry["nbytes"]


def _header(
    weights: TorchStageWeights, key: dict[str, Any], source: dict[str, Any]
) -> tuple[dict[str, Any], list[Any]]:
    """The header (offsets from the data's start) and the tensors it lists."""
    slots, tensors = _layout(weights)
    entries, at = [], 0
    for t in tensors:
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _ITEMSIZE:
            raise ValueError(f"a held tensor of dtype {dtype} cannot be cached")
        at = -(-at // _ALIGN) * _ALIGN
        nbytes = t.numel() * _ITEMSIZE[dtype]
        entries.append({"dtype": dtype, "shape": list(t.shape), "offset": at, "nbytes": nbytes})
        at += nbytes
    header = {
        "key": key,
        "source": source,
        "dtype": str(weights.dtype).removeprefix("torch."),
        "layers": len(weights.blocks),
        "slots": slots,
        "tensors": entries,
        "data_offset": 0,
        "data_bytes": at,
        "digest": "0" * 32,
    }
    # The data starts on a page boundary after the header; 64 bytes to spare
    # for the digits of data_offset itself.
    length = len(MAGIC) + 8 + len(_canonical(header)) + 64
    header["data_offset"] = -(-length // _PAGE) * _PAGE
    del header["digest"]
    return header, tensors


def write_weights(
    torch: Any,
    fd: int,
    weights: TorchStageWeights,
    key: dict[str, Any],
    source: dict[str, Any],
    stopping: Callable[[], bool] = lambda: False,
) -> int:
    """Write the stage to the open file ``fd`` (at its start); its size in bytes.
    ``source``: what the cache's clean-up reads back (the GGUF file's path,
    size and mtime), outside the key. ``stopping`` is asked between pieces:
    True raises ``InterruptedError`` (the process is exiting)."""
    header, tensors = _header(weights, key, source)
    digest = xxhash.xxh3_128()
    digest.update(_canonical(header))
    for piece in _pieces(torch, header, tensors, stopping):
        digest.update(piece)
    header["digest"] = digest.hexdigest()
    text = _canonical(header)
    head = MAGIC + len(text).to_bytes(8, "little") + text
    if len(head) > header["data_offset"]:
        raise ValueError("the header outgrew its pages")
    _write_all(fd, memoryview(head + bytes(header["data_offset"] - len(head))))
    for piece in _pieces(torch, header, tensors, stopping):
        _write_all(fd, piece)
    return int(header["data_offset"] + header["data_bytes"])


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


def read_header(fd: int) -> dict[str, Any]:
    """The header of the open file ``fd``, its framing checked (not its digest)."""
    head = os.pread(fd, len(MAGIC) + 8, 0)
    if len(head) < len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
        raise StaleWeights("not a meshnet weights file")
    length = int.from_bytes(head[len(MAGIC) :], "little")
    if length > _MAX_HEADER:
        raise StaleWeights(f"a header of {length} bytes")
    text = os.pread(fd, length, len(head))
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise StaleWeights("an unreadable header") from None
    if not isinstance(header, dict):
        raise StaleWeights("an unreadable header")
    return header


def read_weights(
    torch: Any, path: Path, key: dict[str, Any], embedding: Callable[[], MappedEmbedding | None]
) -> TorchStageWeights:
    """The stage in ``path`` written under ``key``, its tensors views of the
    file's mapping; ``embedding`` gives the mapped file-form embedding where the
    stage has one. ``StaleWeights`` for a file that cannot be used (absent,
    another key, cut short, not ours, its digest wrong); ``FileNotFoundError``
    passes as it is."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise StaleWeights("not a regular file of this user")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise StaleWeights("writable by others")
        header = read_header(fd)
        if header.get("key") != key:
            raise StaleWeights("written for another file, layer range or torch")
        try:
            end = int(header["data_offset"]) + int(header["data_bytes"])
        except (KeyError, TypeError, ValueError):
            raise StaleWeights("an unreadable header") from None
        if end != info.st_size:
            raise StaleWeights(f"{info.st_size} bytes where its header says {end}")
        mapped = mmap.mmap(fd, info.st_size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    data = np.frombuffer(mapped, np.uint8)
    try:
        return _rebuild(torch, header, data, embedding)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
        raise StaleWeights(f"an inconsistent header ({type(exc).__name__}: {exc})") from None


def _rebuild(
    torch: Any,
    header: dict[str, Any],
    data: np.ndarray,
    embedding: Callable[[], MappedEmbedding | None],
) -> TorchStageWeights:
    claimed = header.pop("digest", None)
    digest = xxhash.xxh3_128()
    digest.update(_canonical(header))
    base, size = int(header["data_offset"]), int(header["data_bytes"])
    digest.update(data[base : base + size].data.cast("B"))
    if claimed != digest.hexdigest():
        raise StaleWeights("its digest does not match its bytes")
    tensors = []
    for entry in header["tensors"]:
        offset, nbytes, dtype = int(entry["offset"]), int(entry["nbytes"]), entry["dtype"]
        shape = tuple(int(n) for n in entry["shape"])
        if dtype not in _ITEMSIZE or nbytes != math.prod(shape) * _ITEMSIZE[dtype]:
            raise ValueError(f"a tensor of {nbytes} bytes as {dtype} {shape}")
        if offset < 0 or offset % _ALIGN or offset + nbytes > size:
            raise ValueError(f"a tensor at {offset}..{offset + nbytes} outside the data")
        raw = torch.from_numpy(data[base + offset : base + offset + nbytes])
        tensors.append(raw.view(getattr(torch, dtype)).reshape(shape))
    held: dict[str, Any] = {}
    for slot in header["slots"]:
        name = slot["slot"]
        if "same" in slot:
            held[name] = held[slot["same"]]
        elif slot.get("mapped"):
            held[name] = embedding()
            if held[name] is None:
                raise ValueError("the file's embedding is no longer mapped")
        elif "int4" in slot:
            parts = tuple((tensors[p], tensors[sz]) for p, sz in slot["int4"])
            shape = (int(slot["shape"][0]), int(slot["shape"][1]))
            held[name] = Int4Matrix(parts, shape, str(slot["source"]))
        else:
            held[name] = tensors[slot["tensor"]]
    blocks = []
    for i in range(int(header["layers"])):
        prefix = f"blocks.{i}."
        blocks.append(TorchLayer(**{f.name: held.get(prefix + f.name) for f in fields(TorchLayer)}))
    if header["dtype"] not in _ITEMSIZE or header["dtype"] == "uint8":
        raise ValueError(f"a stage computing in {header['dtype']}")
    mapped_bytes = sum(int(e["nbytes"]) for e in header["tensors"])
    return TorchStageWeights(
        blocks,
        held.get("embed"),
        held.get("norm"),
        held.get("lm_head"),
        getattr(torch, header["dtype"]),
        torch.device("cpu"),
        mapped_bytes,
    )
