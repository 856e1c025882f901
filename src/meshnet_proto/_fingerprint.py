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
    dtype = arr.dtype
    if dtype.hasobject:
        # Its buffer holds pointers, not values.
        raise TypeError(f"cannot fingerprint an array of dtype {dtype} (it holds objects)")
    if not (dtype.byteorder in _LITTLE and arr.flags.c_contiguous):
        # The wire is little-endian C order; the same values hash the same.
        arr = np.ascontiguousarray(arr.astype(dtype.newbyteorder("<"), copy=False))
        dtype = arr.dtype
    # A decode step hashes 16 KiB: the calls around the hash are most of its
    # cost, so the framing is remembered per (shape, dtype) and the array is
    # hashed through its own buffer (C-contiguous: its bytes, in order).
    digest = xxhash.xxh3_128(_framing(arr.shape, dtype))
    digest.update(arr)  # type: ignore[arg-type]  # an ndarray is a buffer
    return digest.digest()


# Byte orders that are little-endian here: "|" (one byte), "<", and "=" on a
# little-endian machine.
_LITTLE = ("|", "<", "=") if sys.byteorder == "little" else ("|", "<")


@functools.lru_cache(maxsize=256)  # a session's chunks share a few shapes
def _framing(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    # "|" appears in neither a shape nor a dtype name, so the framing is
    # unambiguous. Equal dtypes share a name ("=f4" and "<f4": float32).
    return b"meshnet-tensor|%b|%b|" % (
        ",".join(map(str, shape)).encode("ascii"),
        dtype.name.encode("ascii"),
    )
