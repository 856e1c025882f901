"""Sampling at the last stage (wire-2 §3.13): the ``X-Meshnet-Sample`` header.

A chunk that carries it asks the node that answers it (the last stage) to
draw the next token from its logits and answer the token id, not the logits:
4 bytes up the chain instead of ``vocab * 4``. The value is a comma-separated
list of ``name=value`` parameters, each name at most once, ``seed`` required:

    seed=8412337,temperature=0.7,top_p=0.9,top_k=40,min_p=0.05,logprobs=5

Numbers are checked here, where a peer's bytes become values: a name this
version does not know, a value outside its range, a NaN or an infinity is
400 ``bad_sample`` before the body is read.

``X-Meshnet-Allow`` (wire-2 §3.13, "A mask") narrows the draw to the ids
a sender's grammar allows next (structured output, a forced tool call), so
that a constrained token is drawn where the logits are made too: a bitmask
over the vocabulary, zstd-compressed, in unpadded base64url. Its bytes are
bounded before they become memory: the value's length, then the frame's
declared content size, then the decompression itself. The draw itself (what a node
does with the parameters) is not the core's: it is a pure function of the
logits, the parameters and ``(seed, position)``, specified in wire-2 §3.13.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from dataclasses import dataclass, replace
from typing import Any

import zstandard

from ._errors import ErrorCode, ProtocolError
from ._integers import MAX_UINT_DIGITS, parse_canonical_uint
from ._limits import Limits

__all__ = ["MAX_ALLOW_MASK_BYTES", "MAX_ALLOW_VALUE", "MAX_SAMPLE_LOGPROBS", "SampleSpec"]

H_SAMPLE = b"x-meshnet-sample"
H_ALLOW = b"x-meshnet-allow"
# The mask of a vocabulary below 2**24 ids (§3.13's bound on a sampling stage).
MAX_ALLOW_MASK_BYTES = 2**24 // 8
# The header's value: the mask compressed, in base64; inside any node's 16 KiB
# head with room for the rest. A sender whose mask compresses worse sends
# no mask and draws from the logits itself (§3.13's compatibility path).
MAX_ALLOW_VALUE = 12 * 1024
_BASE64URL = re.compile(rb"[A-Za-z0-9_-]+")
# OpenAI's top_logprobs ceiling: an answer holds at most this many alternatives.
MAX_SAMPLE_LOGPROBS = 20
# The longest value a sender of every parameter at its longest writes is
# ~170 bytes; anything longer is refused before it is split.
MAX_SAMPLE_VALUE = 256
MAX_TEMPERATURE = 100.0
TOP_K_CEILING = 2**31  # top_k < this; 0: no cut
_NAME_VALUE = re.compile(rb"([a-z_]{1,16})=([0-9][0-9.e+-]{0,31})")
# A decimal as Python's repr(float) writes one (no sign: every parameter is >= 0).
_DECIMAL = re.compile(rb"[0-9]{1,20}(?:\.[0-9]{1,20})?(?:e[+-]?[0-9]{1,3})?")


@dataclass(frozen=True, slots=True, kw_only=True)
class SampleSpec:
    """How the last stage draws a chunk's next token (wire-2 §3.13).

    ``seed`` keys the draw, and the token's position counts it: the same
    logits, parameters, seed and position give the same token on any node.
    ``logprobs``: None answers the token id alone (int32 ``[1, 1]``); ``k``
    answers float32 ``[1, 2 + 2k]``: the token, its logprob, then ``k``
    (id, logprob) pairs, most likely first.
    """

    seed: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    logprobs: int | None = None
    # ``X-Meshnet-Allow``: bit ``i`` (little-endian within each byte) set when
    # id ``i`` may be drawn; None draws from every id.
    allow: bytes | None = None

    def __post_init__(self) -> None:
        problem = _problem(self)
        if problem is not None:
            raise ValueError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def allow_value(self) -> bytes | None:
        """``X-Meshnet-Allow``'s value for ``allow`` (None without a mask): a
        sender whose mask makes a value over ``MAX_ALLOW_VALUE`` sends no
        mask and no sample, and draws from the logits itself."""
        return None if self.allow is None else allow_value(self.allow)

    def to_value(self) -> bytes:
        """The header value, canonically: seed first, then every parameter
        that differs from its default (floats as ``repr`` writes them, which
        parse back to the same float)."""
        parts = [f"seed={self.seed}"]
        if self.temperature != 1.0:
            parts.append(f"temperature={self.temperature!r}")
        if self.top_p != 1.0:
            parts.append(f"top_p={self.top_p!r}")
        if self.top_k:
            parts.append(f"top_k={self.top_k}")
        if self.min_p:
            parts.append(f"min_p={self.min_p!r}")
        if self.logprobs is not None:
            parts.append(f"logprobs={self.logprobs}")
        return ",".join(parts).encode("ascii")


def _is_uint(value: object, ceiling: int) -> bool:
    return type(value) is int and 0 <= value < ceiling


def _is_float(value: object, low: float, high: float, *, open_low: bool = False) -> bool:
    if type(value) not in (float, int) or not math.isfinite(value):  # type: ignore[arg-type]
        return False
    number = float(value)  # type: ignore[arg-type]
    return (low < number if open_low else low <= number) and number <= high


def _problem(spec: SampleSpec) -> str | None:
    """What is wrong with ``spec``'s values, or None: the one rule for the
    parser and for hand-built instances."""
    if not _is_uint(spec.seed, 10**MAX_UINT_DIGITS):
        return "seed must be an int in 0..10**19-1"
    if not _is_float(spec.temperature, 0.0, MAX_TEMPERATURE):
        return f"temperature must be in [0, {MAX_TEMPERATURE:g}]"
    if not _is_float(spec.top_p, 0.0, 1.0, open_low=True):
        return "top_p must be in (0, 1]"
    if not _is_uint(spec.top_k, TOP_K_CEILING):
        return f"top_k must be an int in 0..{TOP_K_CEILING - 1}"
    if not _is_float(spec.min_p, 0.0, 1.0):
        return "min_p must be in [0, 1]"
    if spec.logprobs is not None and not _is_uint(spec.logprobs, MAX_SAMPLE_LOGPROBS + 1):
        return f"logprobs must be an int in 0..{MAX_SAMPLE_LOGPROBS} or absent"
    allow = spec.allow
    if allow is not None and not (type(allow) is bytes and 0 < len(allow) <= MAX_ALLOW_MASK_BYTES):
        return f"allow must be 1 to {MAX_ALLOW_MASK_BYTES} bytes of mask or absent"
    return None


def _bad(message: str) -> ProtocolError:
    return ProtocolError(message, code=ErrorCode.BAD_SAMPLE, header="x-meshnet-sample")


def _number(name: bytes, raw: bytes) -> float | int:
    if name in (b"seed", b"top_k", b"logprobs"):
        try:  # wire-2 §2.3's one spelling of an integer, as every header's
            return parse_canonical_uint(raw, header=H_SAMPLE)
        except ProtocolError:
            raise _bad(
                f"x-meshnet-sample: {name.decode()} must be a canonical unsigned integer"
            ) from None
    if _DECIMAL.fullmatch(raw) is None:
        raise _bad(f"x-meshnet-sample: {name.decode()} must be a decimal number")
    return float(raw)  # finite: at most 20 digits and an exponent of 3 digits may overflow


_NAMES = frozenset({b"seed", b"temperature", b"top_p", b"top_k", b"min_p", b"logprobs"})


def parse_sample_value(raw: bytes) -> SampleSpec:
    """``X-Meshnet-Sample``'s value as a ``SampleSpec``; ``ProtocolError``
    400 ``bad_sample`` naming the first problem."""
    if len(raw) > MAX_SAMPLE_VALUE:
        raise _bad(f"x-meshnet-sample: longer than {MAX_SAMPLE_VALUE} bytes")
    given: dict[str, Any] = {}
    for item in raw.split(b","):
        match = _NAME_VALUE.fullmatch(item)
        if match is None:
            raise _bad("x-meshnet-sample: expected comma-separated name=value parameters")
        name, value = match.groups()
        if name not in _NAMES:
            raise _bad(f"x-meshnet-sample: unknown parameter {name.decode()!r}")
        if name.decode() in given:
            raise _bad(f"x-meshnet-sample: {name.decode()} given twice")
        given[name.decode()] = _number(name, value)
    if "seed" not in given:
        raise _bad("x-meshnet-sample: seed is required")
    try:  # the dataclass's defaults and its one range check, as a hand-built spec's
        return SampleSpec(**given)
    except ValueError as problem:
        raise _bad(f"x-meshnet-sample: {problem}") from None


def _bad_allow(message: str) -> ProtocolError:
    return ProtocolError(
        f"x-meshnet-allow: {message}", code=ErrorCode.BAD_SAMPLE, header="x-meshnet-allow"
    )


def parse_allow_value(raw: bytes) -> bytes:
    """``X-Meshnet-Allow``'s mask; 400 ``bad_sample`` naming the header for
    a value too long, not base64url, not one zstd frame that declares its
    size, or a size over ``MAX_ALLOW_MASK_BYTES``."""
    if len(raw) > MAX_ALLOW_VALUE:
        raise _bad_allow(f"longer than {MAX_ALLOW_VALUE} bytes")
    if _BASE64URL.fullmatch(raw) is None or len(raw) % 4 == 1:
        raise _bad_allow("expected unpadded base64url")
    try:
        frame = base64.urlsafe_b64decode(raw + b"=" * (-len(raw) % 4))
        size = zstandard.frame_content_size(frame)
    except (binascii.Error, zstandard.ZstdError):
        raise _bad_allow("expected one zstd frame") from None
    if not 0 < size <= MAX_ALLOW_MASK_BYTES:  # -1: the frame does not say
        raise _bad_allow(f"the frame must declare 1 to {MAX_ALLOW_MASK_BYTES} bytes")
    try:
        # zstd itself checks the output against the declared size (a frame
        # that holds less or more is corrupt to it), and no more is written.
        return zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    except zstandard.ZstdError:
        raise _bad_allow("the zstd frame does not decode") from None


def allow_value(mask: bytes) -> bytes:
    """The header value of a mask (zstd level 3: a 49k-id mask is ~0.1-2 KiB)."""
    frame = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(mask)
    return base64.urlsafe_b64encode(frame).rstrip(b"=")


def parse_sample(
    values: dict[bytes, bytes], fields: dict[str, Any], limits: Limits, sequencing: bool
) -> None:
    """The sample header group (wire-2 §3.13), after the tensor's: a sampled
    chunk is one sequence (batch 1); a mask only with a sample."""
    raw = values.get(H_SAMPLE)
    raw_allow = values.get(H_ALLOW)
    if raw is None:
        if raw_allow is not None:
            raise _bad_allow("a mask is only for a sampled chunk (x-meshnet-sample)")
        fields["sample"] = None
        return
    shape = fields["shape"]
    if len(shape) >= 2 and shape[0] != 1:
        raise _bad(f"x-meshnet-sample: sampling is for batch 1; this chunk has batch {shape[0]}")
    spec = parse_sample_value(raw)
    if raw_allow is not None:
        spec = replace(spec, allow=parse_allow_value(raw_allow))
    fields["sample"] = spec


def sample_pairs(spec: SampleSpec) -> list[tuple[bytes, bytes]]:
    pairs = [(b"X-Meshnet-Sample", spec.to_value())]
    allow = spec.allow_value()
    if allow is not None:
        pairs.append((b"X-Meshnet-Allow", allow))
    return pairs


def valid_sample_field(value: object) -> bool:
    """For hand-built headers: None or a ``SampleSpec`` (which checked itself)."""
    return value is None or isinstance(value, SampleSpec)
