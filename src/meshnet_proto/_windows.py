"""Verify windows and rewinds (wire-2 §3.16): the ``X-Meshnet-Draft`` and
``X-Meshnet-After`` headers.

A window is a sampled chunk ``[t, d1 … dk]`` whose last ``k`` tokens are
drafts the node that answers verifies in one pass; ``X-Meshnet-Draft``
names them (1 to 64 ids, each below 2^31, comma-separated). A chunk 0 with
``X-Meshnet-After: position=F,epoch=E`` follows its session once it holds
``F`` tokens in its ``E``-th line: several windows may then be in the chain
at once, and a chunk at ``p < F`` rewinds the session to ``p`` first.

Here are their grammars and what the head alone decides about them (400
``bad_draft`` / ``bad_after``); how a node routes a chunk that carries
``After`` is the sequencer's (``_rewinds``). And the answer's
``X-Meshnet-Accepted``: the drafts the window accepted, read on answers only.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any

from ._errors import ErrorCode, ProtocolError
from ._integers import MAX_UINT_DIGITS
from ._limits import Limits

__all__ = ["MAX_DRAFT", "AfterSpec"]

H_DRAFT = b"x-meshnet-draft"
H_AFTER = b"x-meshnet-after"
H_ACCEPTED = b"x-meshnet-accepted"
# At most 64 drafts a window (wire-2 §3.16): what one verify pass is worth.
MAX_DRAFT = 64
# A draft is a token id: int32 on the wire, so below 2^31 (10 digits at most).
DRAFT_ID_CEILING = 2**31
# 64 ids of 10 digits and 63 commas: a longer value is refused before it is split.
MAX_DRAFT_VALUE = MAX_DRAFT * 10 + MAX_DRAFT - 1
_UINT_CEILING = 10**MAX_UINT_DIGITS
_ID = rb"(?:0|[1-9][0-9]{0,9})"
_DRAFT = re.compile(_ID + rb"(?:," + _ID + rb"){0,%d}" % (MAX_DRAFT - 1))
_UINT = rb"(0|[1-9][0-9]{0,%d})" % (MAX_UINT_DIGITS - 1)
_AFTER = re.compile(rb"position=" + _UINT + rb",epoch=" + _UINT)
# 0 to 64, canonical: at most two digits, no leading zero (the range is checked after).
_ACCEPTED = re.compile(rb"0|[1-9][0-9]?")


@dataclass(frozen=True, slots=True)
class AfterSpec:
    """``X-Meshnet-After`` (wire-2 §3.16): the chunk follows its session once
    the session holds ``position`` tokens, in its ``epoch``-th line (the
    number of rewinds it has had)."""

    position: int
    epoch: int

    def __post_init__(self) -> None:
        for name in ("position", "epoch"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value < _UINT_CEILING:
                raise ValueError(f"{name} must be an int in 0..10**19-1, got {value!r}")

    def to_value(self) -> bytes:
        return f"position={self.position},epoch={self.epoch}".encode("ascii")


def _bad_draft(message: str) -> ProtocolError:
    return ProtocolError(
        f"x-meshnet-draft: {message}", code=ErrorCode.BAD_DRAFT, header="x-meshnet-draft"
    )


def _bad_after(message: str) -> ProtocolError:
    return ProtocolError(
        f"x-meshnet-after: {message}", code=ErrorCode.BAD_AFTER, header="x-meshnet-after"
    )


def parse_draft_value(raw: bytes) -> tuple[int, ...]:
    """``X-Meshnet-Draft``'s value: 1 to 64 canonical ids below 2^31; else
    ``ProtocolError`` 400 ``bad_draft``."""
    if len(raw) > MAX_DRAFT_VALUE or _DRAFT.fullmatch(raw) is None:
        raise _bad_draft(
            f"expected 1 to {MAX_DRAFT} comma-separated canonical token ids (no whitespace)"
        )
    ids = tuple(int(part) for part in raw.split(b","))
    if max(ids) >= DRAFT_ID_CEILING:
        raise _bad_draft(f"a token id is at most {DRAFT_ID_CEILING - 1}")
    return ids


def parse_after_value(raw: bytes) -> AfterSpec:
    """``X-Meshnet-After``'s value: exactly ``position=<uint>,epoch=<uint>``;
    else ``ProtocolError`` 400 ``bad_after``."""
    match = _AFTER.fullmatch(raw)
    if match is None:
        raise _bad_after("expected position=<uint>,epoch=<uint> (canonical integers, in order)")
    return AfterSpec(int(match[1]), int(match[2]))


def _check_window_shape(draft: tuple[int, ...], fields: dict[str, Any]) -> None:
    """A window is a sampled chunk of batch 1 and exactly ``k + 1`` tokens:
    int32 ids ``[1, k + 1]`` or hidden states ``[1, k + 1, hidden]``."""
    if fields["sample"] is None:
        raise _bad_draft("a window is a sampled chunk: X-Meshnet-Sample is required with it")
    if fields["sample"].allow is not None:
        # One mask fits one row; a window's rows would each need their own.
        raise _bad_draft("a window carries no X-Meshnet-Allow (a mask is for one draw)")
    shape, dtype = fields["shape"], fields["dtype"]
    ids = len(shape) == 2 and dtype == "int32"
    hidden = len(shape) == 3 and dtype != "int32"
    if not (ids or hidden) or shape[0] != 1 or shape[1] != len(draft) + 1:
        raise _bad_draft(
            f"{len(draft)} drafts need a chunk of int32 [1, {len(draft) + 1}] or hidden "
            f"states [1, {len(draft) + 1}, hidden]; this one is {dtype} "
            f"[{', '.join(map(str, shape))}]"
        )


def check_after_place(after: AfterSpec, index: int | None, position: int | None) -> None:
    """400 ``bad_after`` unless the chunk is a run's chunk 0 with a position
    at most the one it follows (the parser's check, and the sequencer's for
    headers built by hand)."""
    if index != 0:
        raise _bad_after("only a run's chunk 0 may carry it")
    if position is None:
        raise _bad_after("a chunk that carries it must carry X-Meshnet-Position")
    if position > after.position:
        raise _bad_after(
            f"the chunk's position {position} is past the position {after.position} it follows"
        )


def parse_windows(
    values: dict[bytes, bytes], fields: dict[str, Any], limits: Limits, sequencing: bool
) -> None:
    """The window headers' group (wire-2 §3.16), after the sample header's.

    Their grammar is checked on every message; what they say about the chunk
    (a sampled window of ``k + 1`` tokens; a run's chunk 0 at or before
    ``F``) only where the chunk is sequenced: a gateway checks the grammar
    and otherwise ignores them (wire-2 §2.2)."""
    raw_draft, raw_after = values.get(H_DRAFT), values.get(H_AFTER)
    draft = after = None
    if raw_draft is not None:
        draft = parse_draft_value(raw_draft)
        if sequencing:
            _check_window_shape(draft, fields)
    if raw_after is not None:
        after = parse_after_value(raw_after)
        if sequencing:
            check_after_place(after, fields["chunk_index"], fields["position"])
    fields["draft"], fields["after"] = draft, after


def parse_accepted(values: dict[bytes, bytes], fields: dict[str, Any]) -> None:
    """An answer's ``X-Meshnet-Accepted`` (wire-2 §3.16): absent, or the
    drafts its window accepted, a canonical integer 0..64; else 400
    ``bad_draft`` naming it (a client turns that into 502
    ``downstream_bad_response``: the answer is the downstream's fault).

    Answer-only: a request's is never collected, so never read here — it is
    ignored as an unknown header is (§2.2), not even its form checked."""
    raw = values.get(H_ACCEPTED)
    if raw is None:
        fields["accepted"] = None
        return
    if _ACCEPTED.fullmatch(raw) is None or int(raw) > MAX_DRAFT:
        raise ProtocolError(
            f"x-meshnet-accepted: expected a canonical integer 0..{MAX_DRAFT}",
            code=ErrorCode.BAD_DRAFT,
            header="x-meshnet-accepted",
        )
    fields["accepted"] = int(raw)


def window_pairs(
    draft: tuple[int, ...] | None, after: AfterSpec | None, accepted: int | None = None
) -> list[tuple[bytes, bytes]]:
    pairs = []
    if draft is not None:
        pairs.append((b"X-Meshnet-Draft", ",".join(map(str, draft)).encode("ascii")))
    if after is not None:
        pairs.append((b"X-Meshnet-After", after.to_value()))
    if accepted is not None:
        pairs.append((b"X-Meshnet-Accepted", str(accepted).encode("ascii")))
    return pairs


def checked_draft(value: object) -> tuple[int, ...] | None:
    """For hand-built headers: None, or 1 to 64 ids below 2^31 as a tuple of
    ints (any sequence of integer-likes is taken, as a shape is); else
    ``ValueError``."""
    if value is None:
        return None
    problem = ValueError(
        f"draft must be None or 1 to {MAX_DRAFT} ints in 0..{DRAFT_ID_CEILING - 1}, got {value!r}"
    )
    if isinstance(value, (str, bytes)):
        raise problem
    try:
        ids = tuple(operator.index(item) for item in value)  # type: ignore[attr-defined]
    except TypeError:
        raise problem from None
    if any(isinstance(item, bool) for item in value):  # type: ignore[attr-defined]
        raise problem
    if not 1 <= len(ids) <= MAX_DRAFT or not all(0 <= i < DRAFT_ID_CEILING for i in ids):
        raise problem
    return ids


def valid_after_field(value: object) -> bool:
    """For hand-built headers: None or an ``AfterSpec`` (which checked itself)."""
    return value is None or isinstance(value, AfterSpec)


def valid_accepted_field(value: object) -> bool:
    """For hand-built headers: None or an int (not a bool) in 0..64."""
    return value is None or (type(value) is int and 0 <= value <= MAX_DRAFT)
