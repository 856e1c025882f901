"""What a stage *is*: digests that say which checkpoint, which tensors, which tokenizer.

A chain is only right when every stage runs a slice of the same checkpoint,
with the tokenizer the gateway encodes with (wire-2 §6.1). Three 128-bit
digests (32 lowercase hex) say so without trusting names or paths:

* ``model`` — blake2b-128 of the checkpoint: its parsed config (canonical JSON), its
  tokenizer digest, its tensor directory (every tensor's name, shape, storage
  type) and *sampled* bytes of every tensor (up to three 4 KiB windows: start,
  middle, end). The same for every stage of one checkpoint, and cheap — a few
  reads per tensor, no full read — so a gateway computes it from its own
  ``--model`` (``checkpoint_model_id``). Two checkpoints of one shape but
  other weights (a fine-tune, another seed) differ in their sampled bytes.
* ``weights`` — xxh3_128 of every byte of the tensors this stage holds (its
  layers, and the embedding/norm/head where it has them:
  ``stage.weights.held_tensors``, the loader's own rule). Exact, at the price
  of one read of the stage's share of the file; bytes are read with
  ``os.pread`` into one reused buffer, so the digest adds no resident memory
  (and no mapped pages stay counted). xxh3, not blake2b: at ~1 GB/s blake2b
  was 30-60 % of a small stage's load (docs/performance.md); xxh3 hashes at
  memory speed. Collision resistance against a chosen input buys nothing
  here: a node reports its own identity, so one that lies need not collide.
* ``tokenizer`` — a GGUF file's ``tokenizer.ggml.*`` metadata records (their
  bytes as stored, by key), or a checkpoint directory's ``tokenizer.json``
  bytes; None when the checkpoint has no tokenizer.

The stored bytes are hashed, not the held form, so every engine and dtype
gives the same ``model`` and ``weights``. Bad files fail with the readers'
``CheckpointError`` (a read that comes back short included).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from .errors import CheckpointError
from .formats.config import ModelConfig
from .formats.gguf.checkpoint import hf_name, is_gguf
from .formats.gguf.file import GGUFFile
from .formats.safetensors import Checkpoint
from .progress import LoadPlan
from .source import load_config
from .stage.weights import held_tensors

__all__ = [
    "ModelIdentity",
    "StoredTensor",
    "checkpoint_model_id",
    "model_identity",
    "stored_tensors",
    "tokenizer_digest",
    "weights_digest",
]

WINDOW = 4096  # bytes of one sampled window
BLOCK = 8 * 1024 * 1024  # bytes read at once for the full digest
TOKENIZER_JSON = "tokenizer.json"
_GGUF_TOKENIZER = "tokenizer.ggml."


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """A stage's digests (module docstring) and the layers they cover."""

    model: str
    weights: str
    tokenizer: str | None
    layers: tuple[int, int]


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """Where one tensor's bytes are: its name in the file, storage type
    (GGML type or numpy dtype name), numpy-order shape, file and byte span."""

    name: str
    kind: str
    shape: tuple[int, ...]
    path: Path
    offset: int
    nbytes: int


class _Digest:
    """A 128-bit digest over length-prefixed fields (no two inputs frame alike):
    blake2b, or (``fast``) xxh3_128 for the full read of a stage's bytes."""

    def __init__(self, *, fast: bool = False) -> None:
        self._h: Any = xxhash.xxh3_128() if fast else hashlib.blake2b(digest_size=16)

    def field(self, data: bytes | memoryview) -> None:
        self._h.update(len(data).to_bytes(8, "little"))
        self._h.update(data)

    def stream(self, total: int, blocks: Iterable[memoryview]) -> None:
        """One field of ``total`` bytes given in pieces."""
        self._h.update(total.to_bytes(8, "little"))
        for block in blocks:
            self._h.update(block)

    def hexdigest(self) -> str:
        digest: str = self._h.hexdigest()  # _h is either library's hasher, typed as Any
        return digest


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def stored_tensors(path: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of a GGUF file or checkpoint directory, from the headers
    only, keyed by its transformers name (a GGUF tensor we have no name for
    keeps the file's own)."""
    if is_gguf(path):
        return _gguf_tensors(GGUFFile(path))
    return _safetensors_tensors(Checkpoint(path))


def load_plan(path: str | Path, layers: range, config: ModelConfig) -> LoadPlan:
    """What loading ``layers`` of ``path`` reads, from the headers only: the
    stage's tensors and their stored bytes (``progress``'s total)."""
    stored = stored_tensors(path)
    names = [n for n in held_tensors(config, layers, stored) if n in stored]
    source = Path(path).name if is_gguf(path) else str(path)
    return LoadPlan(len(names), sum(stored[n].nbytes for n in names), layers, source)


def _gguf_tensors(file: GGUFFile) -> dict[str, StoredTensor]:
    found = {}
    for t in file.tensors.values():
        kind = getattr(t.tensor_type, "name", str(t.tensor_type))
        stored = StoredTensor(
            t.name, kind, file.shape(t.name), file.path, int(t.data_offset), int(t.n_bytes)
        )
        found[hf_name(t.name) or t.name] = stored
    return found


def _safetensors_tensors(ckpt: Checkpoint) -> dict[str, StoredTensor]:
    found = {}
    for name in ckpt.weight_map:
        f = ckpt.file_for(name)
        offset, nbytes = f.span(name)
        found[name] = StoredTensor(
            name, f.dtype(name).name, tuple(f.shape(name)), f.path, offset, nbytes
        )
    return found


def tokenizer_digest(path: str | Path) -> str | None:
    """The digest of the checkpoint's tokenizer (module docstring), or None."""
    if is_gguf(path):
        return _gguf_tokenizer(GGUFFile(path))
    tokenizer = Path(path) / TOKENIZER_JSON
    if not tokenizer.is_file():
        return None
    try:
        return _one_field(tokenizer.read_bytes())
    except OSError as exc:
        raise CheckpointError(f"{tokenizer}: {exc.strerror or exc}") from None


def _gguf_tokenizer(file: GGUFFile) -> str | None:
    """The ``tokenizer.ggml.*`` records' bytes as the file has them, by key:
    exact, and a read of a few MiB rather than a decode of the vocabulary."""
    names = file.keys()  # a list (GGUFFile is not a mapping)
    keys = sorted(k for k in names if k.startswith(_GGUF_TOKENIZER))
    if not keys:
        return None
    digest = _Digest()
    with _Files() as files:
        for key in keys:
            span = file.field_span(key)
            assert span is not None  # a key the file listed
            digest.field(key.encode())
            digest.stream(span[1], files.blocks(file.path, *span))
    return digest.hexdigest()


def _one_field(data: bytes) -> str:
    digest = _Digest()
    digest.field(data)
    return digest.hexdigest()


def checkpoint_model_id(path: str | Path, config: ModelConfig | None = None) -> str:
    """The checkpoint's ``model`` digest (module docstring): headers and a few
    sampled windows per tensor, never a full read."""
    return _model_digest(path, config or load_config(path), tokenizer_digest(path))


def _model_digest(path: str | Path, config: ModelConfig, tokenizer: str | None) -> str:
    tensors = stored_tensors(path)
    digest = _Digest()
    digest.field(_canonical(config.to_dict()))
    digest.field((tokenizer or "").encode())
    names = sorted(tensors, key=lambda n: tensors[n].name)
    listed = [tensors[n] for n in names]
    digest.field(_canonical([[t.name, list(t.shape), t.kind] for t in listed]))
    with _Files() as files:
        for name in names:
            t = tensors[name]
            for start, size in _windows(t.nbytes):
                digest.field(files.read(t.path, t.offset + start, size))
    return digest.hexdigest()


def _windows(nbytes: int) -> list[tuple[int, int]]:
    """(start, size) of the sampled windows of a tensor of ``nbytes``: all of
    it when small, else its first, middle and last ``WINDOW`` bytes."""
    if nbytes <= 3 * WINDOW:
        return [(0, nbytes)] if nbytes else []
    return [(0, WINDOW), (nbytes // 2 - WINDOW // 2, WINDOW), (nbytes - WINDOW, WINDOW)]


def weights_digest(path: str | Path, layers: range, config: ModelConfig | None = None) -> str:
    """The ``weights`` digest of the stage of ``layers``: every stored byte of
    the tensors it holds, in the loader's order, each with its directory entry."""
    config = config or load_config(path)
    tensors = stored_tensors(path)
    digest = _Digest(fast=True)
    with _Files() as files:
        for name in held_tensors(config, layers, tensors):
            t = tensors.get(name)
            if t is None:  # the loader refuses it too; say so before reading gigabytes
                raise CheckpointError(f"{path}: the checkpoint has no tensor {name!r}")
            digest.field(_canonical([name, list(t.shape), t.kind]))
            digest.stream(t.nbytes, files.blocks(t.path, t.offset, t.nbytes))
    return digest.hexdigest()


def model_identity(
    path: str | Path, layers: range | None = None, *, config: ModelConfig | None = None
) -> ModelIdentity:
    """The identity of the stage of ``layers`` (None: every layer) of ``path``,
    a GGUF file or checkpoint directory. Reads the stage's share of the file once."""
    config = config or load_config(path)
    span = range(config.num_hidden_layers) if layers is None else layers
    tokenizer = tokenizer_digest(path)
    return ModelIdentity(
        model=_model_digest(path, config, tokenizer),
        weights=weights_digest(path, span, config),
        tokenizer=tokenizer,
        layers=(span.start, span.stop),
    )


class _Files(ExitStack):
    """Open files by path, read with ``os.pread`` into one reused buffer."""

    def __init__(self) -> None:
        super().__init__()
        self._fds: dict[Path, int] = {}
        self._buffer = bytearray()  # grown to the largest read asked, at most BLOCK

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise CheckpointError(f"{path}: {exc.strerror or exc}") from None
            self.callback(os.close, fd)
            self._fds[path] = fd
        return fd

    def read(self, path: Path, offset: int, size: int) -> memoryview:
        """``size`` (at most ``BLOCK``) bytes at ``offset``: a view of the buffer,
        valid until the next read."""
        if len(self._buffer) < size:
            self._buffer = bytearray(size)
        view = memoryview(self._buffer)[:size]
        fd, done = self._fd(path), 0
        while done < size:
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as exc:
                raise CheckpointError(f"{path}: {exc.strerror or exc}") from None
            if n <= 0:
                raise CheckpointError(f"{path}: short read at byte {offset + done} (truncated?)")
            done += n
        return view

    def blocks(self, path: Path, offset: int, size: int) -> Iterator[memoryview]:
        """The ``size`` bytes at ``offset``, ``BLOCK`` at a time."""
        for start in range(0, size, BLOCK):
            yield self.read(path, offset + start, min(BLOCK, size - start))
