"""Sampling at the last stage (wire-2 §3.13): the ``X-Meshnet-Sample`` header.

A chunk that carries it asks the node that answers it (the last stage) to
draw the next token from its logits and answer the token id, not the logits:
4 bytes up the chain instead of ``vocab * 4``. The value is a comma-separated
list of ``name=value`` parameters, each name at most once, ``seed`` required:

    seed=8412337,temperature=0.7,top_p=0.9,top_k=40,min_p=0.05,logprobs=5

Numbers are checked here, where a peer's bytes become values: a name this
version does not know, a value outside its range, a NaN or an infinity is
400 ``bad_sample`` before the body is read. The draw itself (what a node
does with the parameters) is not the core's: it is a pure function of the
logits, the parameters and ``(seed, position)``, specified in wire-2 §3.13.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ._errors import ErrorCode, ProtocolError
from ._integers import MAX_UINT_DIGITS, parse_canonical_uint
from ._limits import Limits

__all__ = ["MAX_SAMPLE_LOGPROBS", "SampleSpec"]

H_SAMPLE = b"x-meshnet-sample"
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

    def __post_init__(self) -> None:
        problem = _problem(self)
        if problem is not None:
            raise ValueError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

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


def parse_sample(
    values: dict[bytes, bytes], fields: dict[str, Any], limits: Limits, sequencing: bool
) -> None:
    """The sample header group (wire-2 §3.13), after the tensor's: a sampled
    chunk is one sequence (batch 1)."""
    raw = values.get(H_SAMPLE)
    if raw is None:
        fields["sample"] = None
        return
    shape = fields["shape"]
    if len(shape) >= 2 and shape[0] != 1:
        raise _bad(f"x-meshnet-sample: sampling is for batch 1; this chunk has batch {shape[0]}")
    fields["sample"] = parse_sample_value(raw)


def sample_pairs(spec: SampleSpec) -> list[tuple[bytes, bytes]]:
    return [(b"X-Meshnet-Sample", spec.to_value())]


def valid_sample_field(value: object) -> bool:
    """For hand-built headers: None or a ``SampleSpec`` (which checked itself)."""
    return value is None or isinstance(value, SampleSpec)
