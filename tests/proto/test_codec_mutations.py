"""decode_tensor on mutated zstd frames: a value or a MeshnetError, nothing else.

The frame walker reads headers a peer wrote (block sizes, content-size
fields, checksum flags); every mutation of a valid frame must end in either
the promised tensor or a 400/413 — never an IndexError, a ZstdError, a
MemoryError or an array of the wrong size.
"""

from __future__ import annotations

import random

import numpy as np
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshnet_proto import Limits, MeshnetError, WireHeaders, encode_tensor
from meshnet_proto._codec import decode_tensor

LIMITS = Limits(max_tensor_bytes=1 << 20)


def frames() -> list[tuple[WireHeaders, bytes]]:
    rng = np.random.default_rng(5)
    out = []
    for shape in [(1, 4, 8), (1, 64, 64), (2, 3), (4096,)]:
        x = rng.standard_normal(shape).astype(np.float32)
        h = WireHeaders.for_array(x, encoding="zstd")
        out.append((h, bytes(encode_tensor(x, encoding="zstd"))))
        # Frames of other shapes: no content size, a checksum, several blocks.
        raw = x.tobytes()
        no_size = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
        checked = zstandard.ZstdCompressor(write_checksum=True).compress(raw)
        out += [(h, no_size), (h, checked)]
    zeros = np.zeros((1, 256, 64), np.float32)  # RLE blocks
    out.append(
        (
            WireHeaders.for_array(zeros, encoding="zstd"),
            bytes(encode_tensor(zeros, encoding="zstd")),
        )
    )
    return out


FRAMES = frames()


def check(headers: WireHeaders, body: bytes) -> None:
    try:
        tensor = decode_tensor(headers, body, limits=LIMITS)
    except MeshnetError as err:
        assert err.status in (400, 413), err
        return
    # Accepted: exactly the promised size. (A flipped literal bit in a frame
    # without a checksum decodes to other values: nothing on the wire can tell.)
    assert tensor.nbytes == headers.nbytes
    assert tensor.shape == headers.shape


def mutate(rng: random.Random, body: bytes) -> bytes:
    data = bytearray(body)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        at = rng.randrange(len(data) + 1)
        if op == 0 and data:
            data[min(at, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 2:
            del data[at : at + rng.randint(1, 16)]
        elif op == 3:
            data = data[:at]
        else:
            data[at:at] = rng.choice([b"\xff\xff\xff\xff", b"\x00" * 4, body[:8]])
    return bytes(data)


def test_thousands_of_random_mutations() -> None:
    rng = random.Random(20261130)
    for _ in range(3000):
        headers, body = rng.choice(FRAMES)
        check(headers, mutate(rng, body))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    index=st.integers(min_value=0, max_value=len(FRAMES) - 1),
    at=st.integers(min_value=0, max_value=20_000),
    insert=st.binary(max_size=12),
    delete=st.integers(min_value=0, max_value=12),
)
def test_property_edited_frames(index: int, at: int, insert: bytes, delete: int) -> None:
    headers, body = FRAMES[index]
    at = min(at, len(body))
    check(headers, body[:at] + insert + body[at + delete :])


@given(body=st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_property_arbitrary_bodies(body: bytes) -> None:
    headers, _ = FRAMES[0]
    check(headers, b"\x28\xb5\x2f\xfd" + body)
    check(headers, body)
