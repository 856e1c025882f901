"""Decompression bombs: a few KiB of zstd that declare or expand to gigabytes.

python-zstandard's one-shot ``decompress(data, max_output_size=n)`` ignores
``n`` when a frame declares its content size, so a careless decoder allocates
whatever the frame claims. ``decode_tensor`` must reject every bomb below
while its peak memory stays near the *promised* size. Peak memory is read
from ``ru_maxrss`` in a fresh subprocess, so nothing this test process did
before can hide the growth.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from meshnet_proto import ProtocolError, WireHeaders
from meshnet_proto._codec import decode_tensor, zstd_body_bound

GiB = 1 << 30
MiB = 1 << 20
BLOCK = 128 * 1024  # the largest block zstd allows
MAGIC = b"\x28\xb5\x2f\xfd"


def rle_bomb(expands_to: int, *, declares: int | None = None) -> bytes:
    """A valid zstd frame of RLE blocks: 4 bytes of input per 128 KiB of zeros."""
    descriptor, content_size = 0x00, b""
    if declares is not None:
        descriptor, content_size = 0xC0, declares.to_bytes(8, "little")
    header = MAGIC + bytes([descriptor, 0x50]) + content_size  # window 1 MiB
    blocks = expands_to // BLOCK
    rle = (BLOCK << 3) | (1 << 1)
    return (
        header
        + (rle.to_bytes(3, "little") + b"\0") * (blocks - 1)
        + ((rle | 1).to_bytes(3, "little") + b"\0")
    )


def test_the_bombs_are_what_they_claim() -> None:
    bomb = rle_bomb(GiB)
    assert len(bomb) < 40 * 1024  # ~32 KiB of input ...
    assert (len(bomb) - 6) // 4 * BLOCK == GiB  # ... for a full GiB of output
    # A small, honest slice of the same shape decompresses as designed.
    small = rle_bomb(2 * BLOCK)
    headers = WireHeaders(shape=(2 * BLOCK // 4,), dtype="float32", encoding="zstd")
    assert not decode_tensor(headers, small).any()


_CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import numpy as np
    from meshnet_proto import Limits, MeshnetError, WireHeaders
    from meshnet_proto._codec import decode_tensor

    sys.path.insert(0, sys.argv[1])
    from test_zstd_bomb import GiB, MiB, rle_bomb

    def peak_kib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    expands = rle_bomb(GiB)                      # no content size, 1 GiB of zeros
    declares = rle_bomb(2 * 128 * 1024, declares=4 * GiB)  # tiny, claims 4 GiB
    at_limit = rle_bomb(GiB, declares=16 * MiB)  # claims the promise, expands to 1 GiB
    lying_big = rle_bomb(GiB, declares=8 * GiB)
    limit = Limits(max_tensor_bytes=16 * MiB)

    def f32(nbytes):
        return WireHeaders(shape=(nbytes // 4,), dtype="float32", encoding="zstd")

    cases = {
        "expands, small promise": (f32(MiB), expands),
        "expands, tiny promise": (f32(4096), expands),
        "expands, promise at the limit": (f32(16 * MiB), expands),
        "declares 4 GiB, small promise": (f32(MiB), declares),
        "declares the promise, expands 1 GiB": (f32(16 * MiB), at_limit),
        "declares 8 GiB, promise at the limit": (f32(16 * MiB), lying_big),
        "truncated": (f32(16 * MiB), expands[: len(expands) // 2]),
        "trailing garbage": (f32(16 * MiB), expands + b"garbage"),
        "bomb as a second frame": (f32(128 * 1024), rle_bomb(128 * 1024) + expands),
    }
    # Import-time and first-use allocations (numpy, zstd contexts) happen here.
    decode_tensor(f32(256 * 1024), rle_bomb(256 * 1024), limits=limit)
    before = peak_kib()
    results = {}
    for name, (headers, body) in cases.items():
        try:
            decode_tensor(headers, body, limits=limit)
        except MeshnetError as error:
            results[name] = [error.status, error.code]
        else:
            results[name] = "accepted"
    after = peak_kib()
    print(json.dumps({"growth_kib": after - before, "results": results}))
    """
)


def test_bombs_are_rejected_with_bounded_memory() -> None:
    tests_dir = __file__.rsplit("/", 1)[0]
    completed = subprocess.run(
        [sys.executable, "-c", _CHILD, tests_dir],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert report["results"] == {
        "expands, small promise": [400, "body_size_mismatch"],
        "expands, tiny promise": [413, "body_too_large"],
        "expands, promise at the limit": [400, "body_size_mismatch"],
        "declares 4 GiB, small promise": [400, "body_size_mismatch"],
        "declares the promise, expands 1 GiB": [400, "bad_zstd_frame"],
        "declares 8 GiB, promise at the limit": [400, "body_size_mismatch"],
        "truncated": [400, "bad_zstd_frame"],
        "trailing garbage": [400, "bad_zstd_frame"],
        "bomb as a second frame": [400, "bad_zstd_frame"],
    }
    # Every claim is >= 1 GiB; the promise is at most 16 MiB; the growth must
    # be near the promise, nowhere near the claim.
    assert report["growth_kib"] * 1024 < 64 * MiB, report


@pytest.mark.parametrize("declares", [GiB, 4 * GiB, 2**64 - 1])
def test_declared_size_is_never_trusted_in_process(declares: int) -> None:
    # Rejected from the frame header alone: nothing is decompressed.
    headers = WireHeaders(shape=(1024,), dtype="float32", encoding="zstd")
    bomb = rle_bomb(2 * BLOCK, declares=declares)
    assert len(bomb) <= zstd_body_bound(headers.nbytes)
    with pytest.raises(ProtocolError) as info:
        decode_tensor(headers, bomb)
    assert (info.value.status, info.value.code) == (400, "body_size_mismatch")
