"""Tensor bodies: zero-copy identity, bounded zstd, through the public API."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from meshnet_proto import (
    EncodingPolicy,
    Limits,
    ProtocolError,
    WireDtypePolicy,
    WireHeaders,
    encode_for_wire,
    encode_tensor,
)
from meshnet_proto._codec import body_bound, decode_tensor, zstd_body_bound
from meshnet_proto._dtypes import WIRE_DTYPES
from meshnet_proto._headers import parse_wire_headers
from meshnet_proto._policy import apply_wire_dtype

BF16 = np.dtype(ml_dtypes.bfloat16)
MAGIC = b"\x28\xb5\x2f\xfd"


def bits(array: np.ndarray) -> bytes:
    """The exact bytes of ``array`` in little-endian C order (NaN payloads included)."""
    unsigned = np.dtype(f"<u{array.dtype.itemsize}")
    return np.ascontiguousarray(array).view(unsigned).astype(unsigned).tobytes()


def raw_block(data: bytes, *, last: bool) -> bytes:
    return ((len(data) << 3) | int(last)).to_bytes(3, "little") + data


def rle_block(byte: int, size: int, *, last: bool) -> bytes:
    return ((size << 3) | (1 << 1) | int(last)).to_bytes(3, "little") + bytes([byte])


def frame(*blocks: bytes, content_size: int | None = None, fcs_bytes: int = 8) -> bytes:
    """A hand-made zstd frame (RFC 8878): window 1 MiB, optional content size."""
    flag = {1: 0, 2: 1, 4: 2, 8: 3}[fcs_bytes] if content_size is not None else 0
    header = MAGIC + bytes([flag << 6, 0x50])
    if content_size is not None:
        header += (content_size - (256 if fcs_bytes == 2 else 0)).to_bytes(fcs_bytes, "little")
    return header + b"".join(blocks)


def h(shape: tuple[int, ...] = (1, 4, 8), dtype: str = "float32", **fields: object) -> WireHeaders:
    return WireHeaders(shape=shape, dtype=dtype, **fields)  # type: ignore[arg-type]


def expect(error: pytest.ExceptionInfo[ProtocolError], status: int, code: str) -> None:
    assert (error.value.status, error.value.code) == (status, code), error.value


# ------------------------------------------------------------------ identity


def test_identity_encode_is_a_read_only_view_without_copy() -> None:
    array = np.arange(32, dtype=np.float32).reshape(1, 4, 8)
    body = encode_tensor(array)
    assert isinstance(body, memoryview)
    assert body.readonly and body.nbytes == 128 and body.format == "B"
    assert np.shares_memory(np.frombuffer(body, dtype=np.uint8), array)
    assert bytes(body) == array.tobytes()


def test_identity_encode_of_bfloat16_is_a_view() -> None:
    array = np.arange(6, dtype=BF16)
    body = encode_tensor(array)
    assert np.shares_memory(np.frombuffer(body, dtype=np.uint8), array)
    assert bytes(body) == array.view(np.uint16).astype("<u2").tobytes()


def test_identity_encode_converts_big_endian_and_strided() -> None:
    big = np.arange(6, dtype=">i4").reshape(2, 3)
    assert bytes(encode_tensor(big)) == np.arange(6, dtype="<i4").tobytes()
    strided = np.arange(24, dtype=np.float32).reshape(2, 3, 4)[:, 1:3]
    assert bytes(encode_tensor(strided)) == np.ascontiguousarray(strided).tobytes()


def test_identity_decode_shares_memory_and_is_read_only() -> None:
    array = np.arange(32, dtype=np.float32).reshape(1, 4, 8)
    body = array.tobytes()
    tensor = decode_tensor(h(), body)
    assert np.shares_memory(tensor, np.frombuffer(body, dtype=np.uint8))
    assert not tensor.flags.writeable
    np.testing.assert_array_equal(tensor, array)
    with pytest.raises(ValueError):
        tensor[0, 0, 0] = 1


def test_identity_decode_of_bytearray_is_read_only_and_shares_memory() -> None:
    body = bytearray(np.arange(32, dtype=np.float32).tobytes())
    tensor = decode_tensor(h(), body)
    assert np.shares_memory(tensor, np.frombuffer(body, dtype=np.uint8))
    assert not tensor.flags.writeable
    body[0:4] = np.float32(42).tobytes()
    assert tensor[0, 0, 0] == 42  # a view, not a copy


def test_identity_decode_of_memoryviews() -> None:
    data = bytearray(b"\x00" * 4 + np.arange(32, dtype=np.float32).tobytes())
    view = memoryview(data)[4:]
    tensor = decode_tensor(h(), view)
    assert np.shares_memory(tensor, np.frombuffer(data, dtype=np.uint8))
    np.testing.assert_array_equal(tensor.reshape(-1), np.arange(32, dtype=np.float32))
    # A memoryview in another format is taken as its bytes.
    as_floats = memoryview(np.arange(32, dtype=np.float32))
    np.testing.assert_array_equal(decode_tensor(h(), as_floats).reshape(-1), np.arange(32))


def test_identity_decode_bfloat16() -> None:
    array = np.array([[1.5, -2.0, np.inf]], dtype=BF16)
    tensor = decode_tensor(h(shape=(1, 3), dtype="bfloat16"), bytes(encode_tensor(array)))
    assert tensor.dtype == BF16
    assert bits(tensor) == bits(array)


@pytest.mark.parametrize("size", [0, 127, 129, 256])
def test_identity_size_must_be_exact(size: int) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_tensor(h(), b"\x00" * size)
    expect(info, 400, "body_size_mismatch")


def test_decode_rejects_hand_built_headers_over_the_limit() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_tensor(h(shape=(1024,)), b"", limits=Limits(max_tensor_bytes=1024))
    expect(info, 413, "tensor_too_large")


@pytest.mark.parametrize("encoding", ["gzip", "Identity"])
def test_encode_rejects_unknown_encodings(encoding: str) -> None:
    with pytest.raises(ValueError):
        encode_tensor(np.zeros(3, np.float32), encoding=encoding)


def test_encode_rejects_non_wire_dtypes() -> None:
    with pytest.raises(ValueError, match="not a wire dtype"):
        encode_tensor(np.zeros(3))


# ---------------------------------------------------------------------- zstd


def test_zstd_round_trip_writes_content_size() -> None:
    array = np.random.default_rng(1).standard_normal((1, 64, 32)).astype(np.float32)
    body = encode_tensor(array, encoding="zstd")
    assert isinstance(body, bytes)
    assert zstandard.frame_content_size(body) == array.nbytes
    tensor = decode_tensor(h(shape=array.shape, encoding="zstd"), body)
    assert bits(tensor) == bits(array)
    assert not tensor.flags.writeable


def test_zstd_with_reused_compressor_and_decompressor() -> None:
    compressor = zstandard.ZstdCompressor(level=3)
    decompressor = zstandard.ZstdDecompressor()
    headers = h(shape=(1, 16), encoding="zstd")
    for seed in range(3):
        array = np.random.default_rng(seed).standard_normal((1, 16)).astype(np.float32)
        body = encode_tensor(array, encoding="zstd", compressor=compressor)
        tensor = decode_tensor(headers, body, decompressor=decompressor)
        assert bits(tensor) == bits(array)
    # A failed decode leaves the decompressor usable.
    with pytest.raises(ProtocolError):
        decode_tensor(headers, body[:-2], decompressor=decompressor)
    assert bits(decode_tensor(headers, body, decompressor=decompressor)) == bits(array)


def test_zstd_frames_without_content_size_are_accepted() -> None:
    array = np.arange(4096, dtype=np.int32)
    body = zstandard.ZstdCompressor(write_content_size=False).compress(array.tobytes())
    assert zstandard.frame_content_size(body) == -1  # unknown
    tensor = decode_tensor(h(shape=(4096,), dtype="int32", encoding="zstd"), body)
    assert bits(tensor) == bits(array)


def test_zstd_streamed_multi_block_frame_with_checksum() -> None:
    array = np.random.default_rng(2).integers(0, 7, 300_000, dtype=np.int32)
    compressor = zstandard.ZstdCompressor(write_checksum=True, write_content_size=False)
    chunker = compressor.compressobj()
    raw = array.tobytes()
    body = b"".join(
        [
            chunker.compress(raw[: len(raw) // 2]),
            chunker.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK),
            chunker.compress(raw[len(raw) // 2 :]),
            chunker.flush(),
        ]
    )
    assert zstandard.get_frame_parameters(body).has_checksum
    tensor = decode_tensor(h(shape=(300_000,), dtype="int32", encoding="zstd"), body)
    assert bits(tensor) == bits(array)
    # The checksum is verified: flip a bit of it.
    corrupt = body[:-1] + bytes([body[-1] ^ 1])
    with pytest.raises(ProtocolError) as info:
        decode_tensor(h(shape=(300_000,), dtype="int32", encoding="zstd"), corrupt)
    expect(info, 400, "bad_zstd_frame")


@pytest.mark.parametrize("fcs_bytes", [2, 4, 8])
def test_hand_made_frames_with_every_content_size_width(fcs_bytes: int) -> None:
    payload = bytes(range(256)) * 2
    body = frame(raw_block(payload, last=True), content_size=512, fcs_bytes=fcs_bytes)
    tensor = decode_tensor(h(shape=(128,), encoding="zstd"), body)
    assert tensor.tobytes() == payload


def test_single_segment_frame_with_one_byte_content_size() -> None:
    # Single-segment: no window descriptor, content size in one byte.
    body = MAGIC + bytes([0x20, 8]) + rle_block(7, 8, last=True)
    tensor = decode_tensor(h(shape=(2,), encoding="zstd"), body)
    assert tensor.tobytes() == b"\x07" * 8


def test_rle_blocks_and_several_blocks() -> None:
    body = frame(rle_block(1, 4, last=False), raw_block(b"\x02" * 4, last=True), content_size=8)
    assert (
        decode_tensor(h(shape=(2,), encoding="zstd"), body).tobytes() == b"\x01" * 4 + b"\x02" * 4
    )


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"", "bad_zstd_frame"),
        (MAGIC, "bad_zstd_frame"),
        (MAGIC + b"\x08\x50" + raw_block(b"\0" * 8, last=True), "bad_zstd_frame"),  # reserved
        (MAGIC + b"\xc0\x50\x08\x00", "bad_zstd_frame"),  # content size cut off
        (frame(), "bad_zstd_frame"),  # no block at all
        (frame(b"\x07\x00\x00"), "bad_zstd_frame"),  # reserved block type
        (frame(raw_block(b"\0" * 8, last=False)), "bad_zstd_frame"),  # no last block
        (frame(raw_block(b"\0" * 8, last=True))[:-1], "bad_zstd_frame"),  # block cut off
        (MAGIC + b"\x04\x50" + raw_block(b"\0" * 8, last=True) + b"\0\0", "bad_zstd_frame"),
        (frame(raw_block(b"\0" * 8, last=True)) + b"\0", "bad_zstd_frame"),  # trailing
        (frame(raw_block(b"\0" * 4, last=True)), "body_size_mismatch"),  # short
        (frame(raw_block(b"\0" * 12, last=True)), "body_size_mismatch"),  # long
        (frame(raw_block(b"\0" * 8, last=True), content_size=9), "body_size_mismatch"),
        (frame(raw_block(b"\0" * 12, last=True), content_size=8), "bad_zstd_frame"),  # lies
        (frame(raw_block(b"\0" * 4, last=True), content_size=8), "bad_zstd_frame"),  # lies
        (b"\x50\x2a\x4d\x18\x04\x00\x00\x00abcd", "bad_zstd_frame"),  # skippable frame
        (MAGIC + b"\x01\x50\x07" + raw_block(b"\0" * 8, last=True), "bad_zstd_frame"),  # dict
        (frame(b"\x14\x00\x00" + b"\xff" * 2), "bad_zstd_frame"),  # corrupt compressed block
    ],
)
def test_bad_zstd_bodies(body: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_tensor(h(shape=(2,), encoding="zstd"), body)
    expect(info, 400, code)
    assert info.value.header is None


def test_too_many_blocks_is_rejected_without_decompressing() -> None:
    # 4096 bytes promised: at most 4096 // 128 + 16 = 48 blocks. 60 empty raw
    # blocks fit the size bound but would make the frame walk cost more CPU
    # than the decompression it guards.
    empties = b"".join(raw_block(b"", last=False) for _ in range(60))
    headers = h(shape=(1024,), encoding="zstd")
    body = frame(empties, rle_block(0, 4096, last=True))
    assert len(body) <= zstd_body_bound(4096)
    with pytest.raises(ProtocolError) as info:
        decode_tensor(headers, body)
    expect(info, 400, "bad_zstd_frame")


def test_compressed_body_over_its_bound_is_413() -> None:
    headers = h(shape=(2,), encoding="zstd")
    body = frame(raw_block(b"\0" * 8, last=True)) + b"\0" * zstd_body_bound(8)
    with pytest.raises(ProtocolError) as info:
        decode_tensor(headers, body)
    expect(info, 413, "body_too_large")


def test_bounds() -> None:
    assert zstd_body_bound(0) > 0
    for size in (0, 1, 1000, 128 * 1024, 1 << 20, 512 << 20):
        incompressible = zstandard.ZstdCompressor().compress(np.random.default_rng(0).bytes(size))
        if size <= 1 << 20:
            assert len(incompressible) <= zstd_body_bound(size)
        assert zstd_body_bound(size) >= size
    with pytest.raises(ValueError):
        zstd_body_bound(-1)
    assert body_bound(h()) == 128
    assert body_bound(h(encoding="zstd")) == zstd_body_bound(128)


# ---------------------------------------------------------- the round trip

SOURCE_DTYPES = ["float32", "float16", "bfloat16", "int32"]


@st.composite
def tensors(draw: st.DrawFn) -> np.ndarray:
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=5))
    name = draw(st.sampled_from(SOURCE_DTYPES))
    if name == "int32":
        return draw(hnp.arrays(np.int32, shape))
    if name == "bfloat16":
        # Any 16-bit pattern is a bfloat16 (NaN payloads included).
        return draw(hnp.arrays(np.uint16, shape)).view(BF16)
    return draw(hnp.arrays(np.dtype(name), shape, elements={"allow_subnormal": True}))


@settings(max_examples=200, deadline=None)
@given(
    tensors(),
    st.sampled_from(list(WireDtypePolicy)),
    st.sampled_from(list(EncodingPolicy)),
    st.sampled_from(["identity", "zstd"]),
)
def test_wire_round_trip_is_bit_exact(
    array: np.ndarray,
    dtype_policy: WireDtypePolicy,
    encoding_policy: EncodingPolicy,
    request_encoding: str,
) -> None:
    try:
        expected = apply_wire_dtype(array, dtype_policy)
    except ProtocolError as error:
        # Only narrowing can fail, and only for a finite value out of range.
        assert error.code in ("float16_overflow", "bfloat16_overflow")
        return
    dtype, encoding, body = encode_for_wire(
        array,
        dtype_policy=dtype_policy,
        encoding_policy=encoding_policy,
        request_encoding=request_encoding,
    )
    assert WIRE_DTYPES[dtype] == expected.dtype
    if encoding_policy is EncodingPolicy.MIRROR:
        assert encoding == request_encoding
    headers = WireHeaders(
        shape=array.shape, dtype=dtype, encoding=encoding, session=str(_SESSION), chunk_index=0
    ).replace(chunk_total=1)
    parsed = parse_wire_headers(headers.to_pairs())
    tensor = decode_tensor(parsed, bytes(body))
    assert tensor.dtype == expected.dtype and tensor.shape == array.shape
    assert bits(tensor) == bits(expected)
    if dtype_policy in (WireDtypePolicy.KEEP, WireDtypePolicy.AUTO_LOSSLESS):
        # Lossless policies give back exactly what was sent: widening back to
        # the wire dtype is exact (NaN payloads too), and narrowing is only
        # chosen when every (finite) value survives it.
        if tensor.dtype.itemsize >= array.dtype.itemsize:
            assert bits(array.astype(tensor.dtype)) == bits(tensor)
        else:
            assert bits(tensor.astype(array.dtype)) == bits(array)


_SESSION = "00000000-0000-4000-8000-000000000000"
