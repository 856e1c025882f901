"""Tensor bodies: identity bytes or one bounded zstd frame (wire-2 §2).

Decoding is where a hostile peer gets to make us allocate, so every size is
fixed by the headers before a byte of the body is looked at:

* identity: the body must be exactly ``headers.nbytes``; the tensor is a
  read-only view over the body (no copy).
* zstd: the compressed body may be at most ``zstd_body_bound(nbytes)``; its
  frame structure is walked first (magic, header, block headers, checksum) so
  a truncated frame, trailing bytes or a second frame are rejected without
  decompressing anything; a declared content size that differs from the
  promise is rejected without being trusted for anything; then the frame is
  decompressed through a stream reader into a buffer of exactly the promised
  size, and one more byte is asked for to prove there is nothing more.

python-zstandard's one-shot ``decompress(data, max_output_size=n)`` is never
used: it ignores ``n`` when the frame declares its content size, so an 8 KiB
frame declaring 4 GiB makes it allocate 4 GiB.
"""

from __future__ import annotations

import numpy as np
import zstandard

from ._dtypes import WIRE_DTYPES, wire_dtype_name
from ._errors import ErrorCode, ProtocolError
from ._headers import WireHeaders
from ._limits import Limits

__all__ = ["body_bound", "decode_tensor", "encode_tensor", "zstd_body_bound"]

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# Largest zstd frame header: magic 4 + descriptor 1 + window 1 + dictionary
# id 4 + content size 8; plus the optional 4-byte checksum at the end.
_ZSTD_FRAME_OVERHEAD = 18 + 4
_ZSTD_BLOCK_MAX = 128 * 1024
# Walking block headers is a Python loop, so a frame of millions of empty
# 3-byte blocks would cost far more CPU to check than to decompress. No
# encoder makes more than one block per flush, and nobody flushes every few
# bytes: one block per 128 bytes of output (plus slack for the last, empty,
# block) is orders of magnitude more than real frames use (one per 128 KiB).
_ZSTD_BYTES_PER_BLOCK = 128
_ZSTD_BLOCK_SLACK = 16
# Window descriptor / dictionary id / content size field sizes (RFC 8878 §3.1.1.1).
_DICT_ID_SIZES = (0, 1, 2, 4)


def zstd_body_bound(nbytes: int) -> int:
    """The largest zstd body accepted for a promised decoded size of ``nbytes``.

    ZSTD_compressBound (what zstd guarantees a frame of ``nbytes`` input never
    exceeds: incompressible data stored as raw blocks) plus the largest frame
    header and a checksum, so any honest encoder's frame fits.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    margin = (_ZSTD_BLOCK_MAX - nbytes) >> 11 if nbytes < _ZSTD_BLOCK_MAX else 0
    return nbytes + (nbytes >> 8) + margin + _ZSTD_FRAME_OVERHEAD


def body_bound(headers: WireHeaders) -> int:
    """How many body bytes a message with ``headers`` may carry on the wire.

    Identity: exactly ``headers.nbytes``; zstd: ``zstd_body_bound(nbytes)``.
    A connection stops reading (413 ``body_too_large``) past this.
    """
    if headers.encoding == "zstd":
        return zstd_body_bound(headers.nbytes)
    return headers.nbytes


def encode_tensor(
    array: np.ndarray,
    *,
    encoding: str = "identity",
    level: int = 1,
    compressor: zstandard.ZstdCompressor | None = None,
) -> bytes | memoryview:
    """The wire body of ``array``: little-endian C-order bytes, maybe one zstd frame.

    Identity returns a read-only ``memoryview`` over the array itself when it
    already is C-contiguous little-endian (else over a converted copy).
    ``zstd`` returns one frame with its content size written, compressed by
    ``compressor`` if given (zstd objects are not thread-safe: keep one per
    thread; it must write the content size, python-zstandard's default) or by
    a new one at ``level``. Raises ``ValueError`` for a non-wire dtype or an
    unknown encoding.
    """
    name = wire_dtype_name(array.dtype)
    if encoding == "identity" and array.flags.c_contiguous and WIRE_DTYPES[name] is array.dtype:
        # Already what the wire wants (a decode step's usual answer): the view
        # at once, without the general path's conversions and checks.
        return array.reshape(-1).view(np.uint8).data.toreadonly()
    if encoding not in ("identity", "zstd"):
        raise ValueError(f"encoding must be 'identity' or 'zstd', got {encoding!r}")
    # No copy when the array already is what the wire wants; a big-endian or
    # strided array is converted once.
    wire = np.ascontiguousarray(array, dtype=WIRE_DTYPES[name])
    # A uint8 view, not memoryview(wire): the buffer protocol cannot describe
    # ml_dtypes' bfloat16, and consumers want plain bytes anyway.
    raw = wire.reshape(-1).view(np.uint8).data.toreadonly()
    if encoding == "identity":
        return raw
    if compressor is None:
        compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return compressor.compress(raw)


def _bad_frame(message: str) -> ProtocolError:
    # No header: the body is at fault, not a header value.
    return ProtocolError(f"zstd body: {message}", code=ErrorCode.BAD_ZSTD_FRAME)


def _size_mismatch(message: str) -> ProtocolError:
    return ProtocolError(message, code=ErrorCode.BODY_SIZE_MISMATCH)


def _walk_zstd_frame(body: memoryview, *, max_blocks: int) -> int | None:
    """Check ``body`` is exactly one complete zstd frame; return its declared size.

    Only the frame's skeleton is read (RFC 8878 §3.1.1): magic, frame header,
    each block's 3-byte header, the checksum. Nothing is decompressed, so this
    cannot allocate; it finds truncation and trailing bytes, which a stream
    reader does not report (it returns short output, or reads on into a second
    frame). Returns the frame content size when the frame declares one.
    """
    size = len(body)
    if size < 4 or body[:4] != _ZSTD_MAGIC:
        # Skippable frames (magic 0x184D2A5?) land here too: the body is one
        # zstd *data* frame, not a container.
        raise _bad_frame("not a zstd frame (bad magic number)")
    if size < 5:
        raise _bad_frame("truncated frame header")
    descriptor = body[4]
    if descriptor & 0x08:
        raise _bad_frame("reserved bit set in the frame header descriptor")
    fcs_flag = descriptor >> 6
    single_segment = bool(descriptor & 0x20)
    has_checksum = bool(descriptor & 0x04)
    pos = 5 + (0 if single_segment else 1) + _DICT_ID_SIZES[descriptor & 0x03]
    fcs_size = (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
    if pos + fcs_size > size:
        raise _bad_frame("truncated frame header")
    declared: int | None = None
    if fcs_size:
        declared = int.from_bytes(body[pos : pos + fcs_size], "little")
        if fcs_size == 2:
            declared += 256  # RFC 8878: the 2-byte field is offset by 256
    pos += fcs_size
    blocks = 0
    while True:
        if pos + 3 > size:
            raise _bad_frame("truncated frame (block header cut off)")
        block = int.from_bytes(body[pos : pos + 3], "little")
        pos += 3
        block_type = (block >> 1) & 0x03
        if block_type == 3:
            raise _bad_frame("reserved block type")
        # An RLE block (type 1) stores one byte whatever its regenerated size.
        pos += 1 if block_type == 1 else block >> 3
        blocks += 1
        if blocks > max_blocks:
            raise _bad_frame(f"more than {max_blocks} blocks for the promised size")
        if pos > size:
            raise _bad_frame("truncated frame (block cut off)")
        if block & 0x01:
            break
    if has_checksum:
        pos += 4
        if pos > size:
            raise _bad_frame("truncated frame (checksum cut off)")
    if pos != size:
        raise _bad_frame(f"{size - pos} bytes after the end of the frame")
    return declared


def _decompress_bounded(
    body: memoryview, nbytes: int, decompressor: zstandard.ZstdDecompressor | None
) -> bytearray:
    max_blocks = nbytes // _ZSTD_BYTES_PER_BLOCK + _ZSTD_BLOCK_SLACK
    declared = _walk_zstd_frame(body, max_blocks=max_blocks)
    if declared is not None and declared != nbytes:
        raise _size_mismatch(
            f"zstd frame declares {declared} bytes of content, the headers promise {nbytes}"
        )
    if decompressor is None:
        decompressor = zstandard.ZstdDecompressor()
    # The promised size, never the frame's: the headers were checked against
    # the limits, the frame was not.
    out = bytearray(nbytes)
    view = memoryview(out)
    filled = 0
    try:
        reader = decompressor.stream_reader(body, read_across_frames=False, closefd=False)
        with reader:
            while filled < nbytes:
                count = reader.readinto(view[filled:])
                if count == 0:
                    break
                filled += count
            # One byte past the promise proves the frame is not longer; the
            # output bound is promised size + 1, never the declared size.
            extra = reader.read(1) if filled == nbytes else b""
    except zstandard.ZstdError as exc:
        raise _bad_frame(f"corrupt frame ({exc})") from None
    finally:
        view.release()
    if filled < nbytes:
        raise _size_mismatch(
            f"zstd body decompresses to {filled} bytes, the headers promise {nbytes}"
        )
    if extra:
        raise _size_mismatch(
            f"zstd body decompresses to more than the {nbytes} bytes the headers promise"
        )
    return out


def decode_tensor(
    headers: WireHeaders,
    body: bytes | bytearray | memoryview,
    *,
    limits: Limits = Limits(),  # noqa: B008 - Limits is frozen: sharing one is safe
    decompressor: zstandard.ZstdDecompressor | None = None,
) -> np.ndarray:
    """The read-only tensor ``body`` carries, as ``headers`` describe it.

    Identity: ``body`` must be exactly ``headers.nbytes`` (else 400
    ``body_size_mismatch``) and the result is a zero-copy view over it.
    zstd: see the module docstring; 413 ``body_too_large`` over
    ``zstd_body_bound``, 400 ``bad_zstd_frame`` or ``body_size_mismatch``.
    ``decompressor`` may be a reusable ``ZstdDecompressor`` (one per thread).
    """
    nbytes = headers.nbytes
    if nbytes > limits.max_tensor_bytes:
        # parse_wire_headers checked this already; hand-built headers did not.
        raise ProtocolError(
            f"tensor of {nbytes} bytes is over the limit of {limits.max_tensor_bytes} bytes",
            code=ErrorCode.TENSOR_TOO_LARGE,
            header="x-meshnet-shape",
        )
    view = memoryview(body)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    if headers.encoding == "identity":
        if len(view) != nbytes:
            raise _size_mismatch(
                f"identity body is {len(view)} bytes, the headers promise {nbytes}"
            )
        data: memoryview | bytearray = view
    else:
        bound = zstd_body_bound(nbytes)
        if len(view) > bound:
            raise ProtocolError(
                f"zstd body is {len(view)} bytes, over the bound of {bound} for a "
                f"{nbytes}-byte tensor",
                code=ErrorCode.BODY_TOO_LARGE,
            )
        data = _decompress_bounded(view, nbytes, decompressor)
    # The array over the buffer in one call (frombuffer + reshape were ~1 us
    # more of a decode step); the buffer holds exactly nbytes, checked above.
    tensor = np.ndarray(headers.shape, headers.numpy_dtype, data)
    # Read-only whatever the buffer: a writable bytearray body must not let a
    # stage scribble over what a replay will compare against.
    tensor.flags.writeable = False
    return tensor
