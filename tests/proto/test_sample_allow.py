"""``X-Meshnet-Allow`` (wire-2 §3.13, "A mask"): the ids a sampled chunk's
draw may choose, as a zstd-compressed bitmask in base64url; every count in
it bounded before it becomes memory."""

from __future__ import annotations

import base64

import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from meshnet_proto import ProtocolError, WireHeaders
from meshnet_proto._headers import parse_wire_headers
from meshnet_proto._sample import MAX_ALLOW_VALUE, allow_value
from meshnet_proto.lowlevel import MAX_ALLOW_MASK_BYTES, SampleSpec

S = "5b1e0c2a-1111-4abc-8def-000000000001"
MASK = bytes([0b1010_0001, 0, 0xFF, 0x01]) * 1536  # a 49,152-id vocabulary


def pairs(allow: bytes | None, sample: bytes | None = b"seed=1") -> list[tuple[bytes, bytes]]:
    out = [
        (b"content-type", b"application/octet-stream"),
        (b"x-meshnet-shape", b"1,1"),
        (b"x-meshnet-dtype", b"int32"),
        (b"x-meshnet-session", S.encode()),
        (b"x-meshnet-chunk-index", b"0"),
        (b"x-meshnet-chunk-total", b"1"),
    ]
    if sample is not None:
        out.append((b"X-Meshnet-Sample", sample))
    if allow is not None:
        out.append((b"X-Meshnet-Allow", allow))
    return out


def b64(frame: bytes) -> bytes:
    return base64.urlsafe_b64encode(frame).rstrip(b"=")


def test_a_mask_travels_with_its_sample_and_parses_back_exactly() -> None:
    spec = SampleSpec(seed=3, temperature=0.0, allow=MASK)
    headers = WireHeaders(shape=(1, 1), dtype="int32", sample=spec)
    sent = dict(headers.to_pairs())
    assert sent[b"X-Meshnet-Sample"] == b"seed=3,temperature=0.0"
    assert len(sent[b"X-Meshnet-Allow"]) < 200  # a regular mask compresses to little
    parsed = parse_wire_headers(headers.to_pairs(), require_sequencing=False)
    assert parsed.sample == spec and parsed.sample.allow == MASK
    assert parse_wire_headers(pairs(allow_value(MASK))).sample == SampleSpec(seed=1, allow=MASK)


@given(st.binary(min_size=1, max_size=4096))
def test_any_mask_a_sender_writes_parses_back(mask: bytes) -> None:
    parsed = parse_wire_headers(pairs(allow_value(mask))).sample
    assert parsed is not None and parsed.allow == mask


def frame_without_size() -> bytes:
    return zstandard.ZstdCompressor(write_content_size=False).compress(MASK)


def bomb() -> bytes:
    # A few hundred bytes that declare (and hold) 16 MiB of zeros.
    return zstandard.ZstdCompressor(level=19).compress(bytes(MAX_ALLOW_MASK_BYTES * 8))


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (b"A" * (MAX_ALLOW_VALUE + 4), "longer than"),
        (b"abc=", "base64url"),
        (b"ab+/", "base64url"),
        (b"abcde", "base64url"),  # 5 characters: no byte string encodes to that
        (b64(b"not a zstd frame at all"), "one zstd frame"),
        (b64(frame_without_size()), "must declare"),
        (b64(zstandard.ZstdCompressor().compress(b"")), "must declare"),
        (b64(bomb()), "must declare"),
        (b64(zstandard.ZstdCompressor().compress(MASK)[:-8]), "does not decode"),
    ],
)
def test_bad_masks_are_400_bad_sample_naming_the_header(value: bytes, words: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_wire_headers(pairs(value))
    error = caught.value
    assert (error.status, error.code, error.header) == (400, "bad_sample", "x-meshnet-allow")
    assert words in str(error)


def test_a_frame_that_holds_less_than_it_declares_is_refused() -> None:
    """The 64-byte frame's header on an 8-byte frame's blocks: zstd checks
    the output against the declared size."""
    header = zstandard.ZstdCompressor(level=1).compress(b"\x01" * 64)[:6]
    short = zstandard.ZstdCompressor(write_content_size=True).compress(b"\x02" * 8)
    with pytest.raises(ProtocolError) as caught:
        parse_wire_headers(pairs(b64(header + short[6:])))
    assert caught.value.header == "x-meshnet-allow"
    assert "does not decode" in str(caught.value)


def test_a_mask_without_a_sample_and_a_window_with_one_are_refused() -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_wire_headers(pairs(allow_value(MASK), sample=None))
    assert (caught.value.code, caught.value.header) == ("bad_sample", "x-meshnet-allow")
    window = [*pairs(allow_value(MASK)), (b"x-meshnet-draft", b"7")]
    window[1] = (b"x-meshnet-shape", b"1,2")
    with pytest.raises(ProtocolError) as caught:
        parse_wire_headers(window)
    assert caught.value.code == "bad_draft" and "X-Meshnet-Allow" in str(caught.value)


@pytest.mark.parametrize("allow", [b"", bytearray(b"\x01"), "x", bytes(MAX_ALLOW_MASK_BYTES + 1)])
def test_hand_built_masks_check_themselves(allow: object) -> None:
    with pytest.raises(ValueError, match="allow"):
        SampleSpec(seed=1, allow=allow)  # type: ignore[arg-type]
