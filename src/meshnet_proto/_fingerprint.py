"""A chunk's identity for replay (wire-2 §3): the digest of its decoded tensor."""

from __future__ import annotations

import functools
import sys

import numpy as np
import xxhash

__all__ = ["tensor_fingerprint"]


def tensor_fingerprint(array: np.ndarray) -> bytes:
    """A 16-byte XXH3-128 digest of a tensor's shape, dtype name and bytes.

    Two chunks are "the same tensor" (wire-2 §3 replay) when their decoded
    values are: the wire encoding does not matter, so the bytes hashed are the
    little-endian C-order element bytes, whatever the array's memory layout.

    Every chunk is fingerprinted on its request's critical path, so speed
    matters: XXH3 runs at ~18 GB/s against BLAKE2b's ~0.8 GB/s here (0.9 ms
    against 21 ms for a 16 MiB chunk). It is not collision-resistant against
    an adversary, and it need not be: a crafted collision only makes the
    crafter's own retransmission get the stored answer of the chunk it sent
    before, in a session it already writes to — nothing another peer relies on.
    """
    arr = np.asarray(array)
    if not (arr.dtype.byteorder in _LITTLE and arr.flags.c_contiguous):
        # The wire is little-endian C order; the same values hash the same.
        arr = np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("<"), copy=False))
    # "|" appears in neither a shape nor a dtype name, so the framing is
    # unambiguous. One update for the framing (a decode step hashes 16 KiB:
    # per-call overhead is most of its cost).
    digest = xxhash.xxh3_128(_framing(arr.shape, arr.dtype.name))
    digest.update(arr.reshape(-1).view(np.uint8).data)
    return digest.digest()


# Byte orders that are little-endian here: "|" (one byte), "<", and "=" on a
# little-endian machine.
_LITTLE = ("|", "<", "=") if sys.byteorder == "little" else ("|", "<")


@functools.lru_cache(maxsize=256)  # a session's chunks share a few shapes
def _framing(shape: tuple[int, ...], dtype_name: str) -> bytes:
    return b"meshnet-tensor|%b|%b|" % (
        ",".join(map(str, shape)).encode("ascii"),
        dtype_name.encode("ascii"),
    )
