"""The repacked weights of a quantized GGUF stage, kept on disk for its next start.

Repacking a GGUF file's blocks into the torch engine's held forms
(``qlinear``: int4pack nibbles and bfloat16 (scale, zero) pairs) was most of
a quantized stage's start (docs/models.md, "Start time"). So the first load
of a stage writes what it built to one file (``weight_file``), in the
background once the stage is up, and every later load of the same stage maps
that file instead: no repack, no copy, its pages shared with the page cache.

The file is named by a digest of its key, and the key is in its header:

* the GGUF file: its size, its mtime (ns) and its sampled ``model`` digest
  (``identity.checkpoint_model_id``: the config, tokenizer, tensor directory
  and three 4 KiB windows of every tensor — a few milliseconds);
* the layer range, the compute dtype;
* what makes the held form: torch's version, its int4pack layout on this CPU
  (``qlinear.int4pack_block``: 64-row blocks on AVX-512, 32 on AVX2 — a file
  moved between the two would give wrong numbers), the kernels' dtype, the
  machine type, and a
  digest of the source of the modules that build it (so a meshnet whose
  repack changed never reads an older file).

A file is used only when its header carries that key, its size is what its
header says, and its digest (xxh3-128 of the header and the data, ~0.1 s a
GiB) matches — else it is ignored, the stage is built from the GGUF file as
without a cache, and the file is written again. Files are written to an
unnamed temporary file (``O_TMPFILE``) linked and renamed into place:
a process stopped while writing leaves nothing, a reader sees a whole file or
none.

The directory is the operator's (``--weights-cache DIR``; by default
``$XDG_CACHE_HOME/meshnet/weights`` or ``~/.cache/meshnet/weights``, made
0700): one writable by another user is refused, as is a file there that is
not this user's own or is writable by others. After each write, files whose
GGUF file is gone or changed are deleted.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import re
import secrets
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...formats.config import ModelConfig
from ...formats.gguf.checkpoint import GGUFCheckpoint
from ...identity import checkpoint_model_id, stored_tensors
from ...stage.weights import held_tensors
from . import qlinear, weight_file, weights
from .qlinear import KERNEL_DTYPE, int4pack_block
from .weight_file import MAGIC, StaleWeights, read_header, read_weights, write_weights
from .weights import MappedEmbedding, TorchStageWeights, gguf_weights, mapped_embedding

__all__ = [
    "FORMAT",
    "CacheStatus",
    "UnsafeDirectory",
    "cache_directory",
    "cached_gguf_weights",
    "checked_directory",
]

FORMAT = 1
SUFFIX = ".weights"
OFF = "off"
AUTO = "auto"
_LOG = logging.getLogger("meshnet.load")
# Writers still running when the interpreter exits are told to stop and
# waited for (``_stop_writers``): a daemon thread inside torch while its
# runtime is torn down aborts the process (SIGABRT, measured).
_EXITING = threading.Event()
_WRITERS: set[threading.Thread] = set()
_EXIT_WAIT_S = 30.0
_MIB = 1024 * 1024
# The temporary names ``_write_file`` gives: ``.<name>.<pid>.<random>.tmp``.
_TEMPORARY = re.compile(r"\.[0-9a-f]{32}\.weights\.(\d+)\.[0-9a-f]{8}\.tmp")


@dataclass(slots=True)
class CacheStatus:
    """What ``/info`` says of a stage's weights cache: ``mapped`` (read from the
    file), ``writing`` (built from the GGUF file, being written), ``written``,
    or ``failed`` (the write did not happen: ``reason``)."""

    state: str
    path: str
    bytes: int = 0
    reason: str = ""
    # Set once a write ended (written or failed): for whoever must wait on it.
    finished: threading.Event = field(default_factory=threading.Event)

    def report(self) -> dict[str, Any]:
        found: dict[str, Any] = {"state": self.state, "path": self.path, "bytes": self.bytes}
        return found | ({"reason": self.reason} if self.reason else {})


def cache_directory(setting: str, environ: Mapping[str, str] = os.environ) -> Path | None:
    """The directory of ``--weights-cache``: None for ``off``; ``auto`` is
    ``$XDG_CACHE_HOME/meshnet/weights`` (``~/.cache`` without it, or with a
    relative one, as the XDG spec says)."""
    if setting == OFF:
        return None
    if setting != AUTO:
        return Path(setting).expanduser()
    base = environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "meshnet" / "weights"


class UnsafeDirectory(ValueError):
    """A cache directory another user owns or may write to."""


def checked_directory(path: Path) -> Path:
    """``path``, made (0700) if need be; ``ValueError`` with one line for one
    that cannot be made or is not a directory, ``UnsafeDirectory`` for one that
    is not this user's or that others may write to: a file planted there would
    be mapped as this stage's weights."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as exc:
        raise ValueError(f"--weights-cache {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"--weights-cache {path}: not a directory")
    if info.st_uid != os.geteuid():
        raise UnsafeDirectory(f"--weights-cache {path}: owned by another user (uid {info.st_uid})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectory(
            f"--weights-cache {path}: writable by others (mode {stat.S_IMODE(info.st_mode):o}); "
            f"chmod go-w it, name another directory, or --weights-cache off"
        )
    return path


def _code_digest() -> str:
    """A digest of the source of the modules that build and store the held form."""
    digest = hashlib.blake2b(digest_size=16)
    for module in (qlinear, weights, weight_file):
        with contextlib.suppress(OSError, TypeError):
            digest.update(Path(str(module.__file__)).read_bytes())
    from ...formats.gguf import blocks, checkpoint, quants

    for module in (blocks, checkpoint, quants):
        with contextlib.suppress(OSError, TypeError):
            digest.update(Path(str(module.__file__)).read_bytes())
    return digest.hexdigest()


def stage_key(
    torch: Any, path: Path, config: ModelConfig, layers: range, dtype: Any
) -> dict[str, Any]:
    """The key of a stage's file (module docstring)."""
    info = path.stat()
    return {
        "format": FORMAT,
        "file": {
            "size": info.st_size,
            "mtime_ns": info.st_mtime_ns,
            "model": checkpoint_model_id(path, config),
        },
        "layers": [layers.start, layers.stop],
        "compute": str(dtype).removeprefix("torch."),
        "torch": str(torch.__version__),
        "int4pack_block": int4pack_block(torch),
        "kernel_dtype": KERNEL_DTYPE,
        "machine": platform.machine(),
        "code": _code_digest(),
    }


def _name(key: dict[str, Any]) -> str:
    text = json.dumps(key, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(text, digest_size=16).hexdigest() + SUFFIX


def cached_gguf_weights(
    setting: str,
    torch: Any,
    ckpt: GGUFCheckpoint,
    config: ModelConfig,
    layers: range,
    *,
    dtype: Any,
    device: Any,
    quantized: bool,
) -> TorchStageWeights:
    """``gguf_weights``, through the cache of ``setting`` (``--weights-cache``:
    ``off``, ``auto`` or a directory) where it applies: a stage held quantized
    on the CPU (the others are dequantized floats, or on a device)."""
    build = functools.partial(
        gguf_weights, torch, ckpt, config, layers, dtype=dtype, device=device, quantized=quantized
    )
    if setting == OFF or not quantized or device.type != "cpu":
        return build()
    try:
        directory = checked_directory(cache_directory(setting) or Path())
    except UnsafeDirectory:
        raise
    except (ValueError, RuntimeError) as exc:  # RuntimeError: no home directory
        if setting != AUTO:
            raise ValueError(str(exc)) from None  # the operator's own directory: refused
        # The default only: a read-only or absent home runs the stage uncached.
        _LOG.warning("weights cache: %s; the stage is not cached", exc)
        held = build()
        held.cache = CacheStatus("failed", "", reason=str(exc))
        held.cache.finished.set()
        return held
    path = Path(ckpt.path)
    key = stage_key(torch, path, config, layers, dtype)
    target = directory / _name(key)
    mapped = _mapped(torch, ckpt, config, layers, key, target)
    if mapped is not None:
        return mapped
    held = build()
    held.cache = CacheStatus("writing", str(target))
    source = {
        "path": str(path.resolve()),
        "size": key["file"]["size"],
        "mtime_ns": key["file"]["mtime_ns"],
    }
    writer = threading.Thread(
        target=_store, args=(torch, held, key, source, target), name="weights-cache", daemon=True
    )
    _WRITERS.add(writer)
    writer.start()
    return held


def _mapped(
    torch: Any,
    ckpt: GGUFCheckpoint,
    config: ModelConfig,
    layers: range,
    key: dict[str, Any],
    target: Path,
) -> TorchStageWeights | None:
    """The stage mapped from ``target``, or None (absent, or not usable: said)."""
    started = time.perf_counter()
    try:
        held = read_weights(torch, target, key, lambda: mapped_embedding(ckpt, config))
    except FileNotFoundError:
        return None
    except (StaleWeights, OSError, ValueError) as exc:
        _LOG.warning("weights cache: %s ignored (%s); rebuilding it", target, exc)
        return None
    _count_read(ckpt, config, layers, held)
    held.cache = CacheStatus("mapped", str(target), _size(target))
    _LOG.info(
        "weights cache: mapped %.1f MiB of layers %d:%d from %s in %.2f s",
        held.shared_with_file / _MIB,
        layers.start,
        layers.stop,
        target,
        time.perf_counter() - started,
    )
    return held


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # replaced meanwhile: the mapping stays valid
        return 0


def _count_read(
    ckpt: GGUFCheckpoint, config: ModelConfig, layers: range, held: TorchStageWeights
) -> None:
    """Tell the load's progress the stage's stored bytes, as a load from the
    GGUF file would (a mapped embedding counted itself when mapped)."""
    stored = stored_tensors(ckpt.path)
    names = [n for n in held_tensors(config, layers, stored) if n in stored]
    if isinstance(held.embed, MappedEmbedding):
        names = [n for n in names if n != "model.embed_tokens.weight"]
    ckpt.progress.on_bytes(sum(stored[n].nbytes for n in names))


def _store(
    torch: Any, held: TorchStageWeights, key: dict[str, Any], source: dict[str, Any], target: Path
) -> None:
    """The writer thread: the file written and renamed into place, at a low
    priority (the stage is serving meanwhile); a failure is a log line."""
    status: CacheStatus = held.cache
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # this thread's nice
    started = time.perf_counter()
    try:
        size = _write_file(torch, held, key, source, target)
    except InterruptedError:  # the process is exiting: the next start writes it
        status.state, status.reason = "failed", "the process exited first"
        status.finished.set()
        return
    except (OSError, ValueError) as exc:
        status.state, status.reason = "failed", str(exc)
        _LOG.warning("weights cache: could not write %s: %s", target, exc)
        status.finished.set()
        return
    status.state, status.bytes = "written", size
    _LOG.info(
        "weights cache: wrote %.1f MiB to %s in %.1f s",
        size / _MIB,
        target,
        time.perf_counter() - started,
    )
    with contextlib.suppress(OSError):
        _prune(target)
    status.finished.set()


def _write_file(
    torch: Any, held: TorchStageWeights, key: dict[str, Any], source: dict[str, Any], target: Path
) -> int:
    """Written unnamed (``O_TMPFILE``), then linked under a temporary name and
    renamed over ``target``: never a partial file under its name."""
    temporary = f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    directory = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    at = {"src_dir_fd": directory, "dst_dir_fd": directory}
    fd = -1
    try:
        try:
            fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600, dir_fd=directory)
            unnamed = True
        except (OSError, AttributeError):  # a file system (or OS) without O_TMPFILE
            flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC
            fd = os.open(temporary, flags, 0o600, dir_fd=directory)
            unnamed = False
        try:
            size = write_weights(torch, fd, held, key, source, _EXITING.is_set)
            if unnamed:  # linkat(AT_SYMLINK_FOLLOW): the dir fds make os.link use it
                os.link(f"/proc/self/fd/{fd}", temporary, follow_symlinks=True, **at)
            os.replace(temporary, target.name, **at)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=directory)
            raise
    finally:
        if fd >= 0:
            os.close(fd)
        os.close(directory)
    return size


@atexit.register
def _stop_writers() -> None:
    """At exit: writers stop at their next piece (their unnamed file goes with
    them) and are waited for, so none is inside torch while it is torn down."""
    _EXITING.set()
    for writer in list(_WRITERS):
        writer.join(_EXIT_WAIT_S)


def _prune(kept: Path) -> None:
    """Delete the directory's weights files whose GGUF file is gone or changed
    (or whose header is unreadable), and the temporary files of processes that
    ended. Files that are not ours (no ``MAGIC``, other names) are left alone."""
    for entry in kept.parent.iterdir():
        if entry == kept:
            continue
        temporary = _TEMPORARY.fullmatch(entry.name)
        with contextlib.suppress(OSError):
            ended = temporary is not None and not _alive(int(temporary.group(1)))
            if ended or (entry.name.endswith(SUFFIX) and _stale(entry)):
                entry.unlink()


def _stale(entry: Path) -> bool:
    fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.pread(fd, len(MAGIC), 0) != MAGIC:
            return False  # not a file of ours
        source = read_header(fd).get("source")
    except StaleWeights:
        return True
    finally:
        os.close(fd)
    if not isinstance(source, dict):
        return True
    try:
        info = os.stat(str(source.get("path")))
    except OSError:
        return True
    return (info.st_size, info.st_mtime_ns) != (source.get("size"), source.get("mtime_ns"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
