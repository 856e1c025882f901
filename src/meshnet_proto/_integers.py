"""The strict integer grammar of wire 2 (wire-2 §2).

Every integer a peer sends us — a shape dimension, a chunk index, a position,
a deadline — goes through :func:`parse_canonical_uint`. ``int()`` is far too
lenient for a wire format: it accepts signs, surrounding whitespace,
underscores and any Unicode decimal digit (``int("٤") == 4``), and it runs in
time quadratic in the number of digits. Two peers that disagree on what a
header means is how request smuggling starts, so exactly one spelling of each
number is accepted.
"""

from __future__ import annotations

import re

from ._errors import ErrorCode, ProtocolError

__all__ = ["parse_canonical_uint"]

# 19 digits always fit an unsigned 64-bit integer (10**19 - 1 < 2**64), which
# is what any other implementation will parse these headers into.
MAX_UINT_DIGITS = 19

# A bytes pattern: ``[0-9]`` then means the ten ASCII bytes and nothing else.
# ``fullmatch`` (not ``$``, which also matches before a trailing newline).
_CANONICAL_UINT = re.compile(rb"0|[1-9][0-9]*")

# How much of a rejected value an error message quotes: enough to recognise
# it, never enough to turn an error body into an amplifier.
_QUOTE_LIMIT = 40


def _quote(raw: bytes) -> str:
    shown = raw[:_QUOTE_LIMIT]
    suffix = "…" if len(raw) > _QUOTE_LIMIT else ""
    return f"{shown!r}{suffix}"


def parse_canonical_uint(value: bytes | str, *, header: str | bytes) -> int:
    """Parse ``value`` as a canonical unsigned decimal integer.

    Accepted: the ASCII bytes ``0``-``9``, 1 to 19 of them, no leading zero
    unless the value is ``0`` itself. Anything else raises
    ``ProtocolError(code=ErrorCode.BAD_INTEGER, header=header)`` (400).
    The length is checked before any conversion so a megabyte of digits
    costs nothing. ``header`` may be the name as the parser holds it (ASCII
    bytes): it is decoded only for an error, so a well-formed value (six a
    message; section decode) costs no decoding.
    """
    if type(value) is bytes:  # what h11 hands over: no conversion
        raw = value
    elif isinstance(value, str):
        # A non-ASCII character can never be part of a canonical integer;
        # encoding leniently keeps the length check meaningful and the error
        # message below uniform.
        raw = value.encode("utf-8", "surrogatepass")
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
    else:
        raise TypeError(f"parse_canonical_uint takes bytes or str, not {type(value).__name__}")
    if 1 <= len(raw) <= MAX_UINT_DIGITS and _CANONICAL_UINT.fullmatch(raw) is not None:
        return int(raw)
    if isinstance(header, bytes):
        header = header.decode("ascii")
    if not 1 <= len(raw) <= MAX_UINT_DIGITS:
        raise ProtocolError(
            f"{header}: expected 1 to {MAX_UINT_DIGITS} ASCII digits, got {len(raw)} bytes "
            f"({_quote(raw)})",
            code=ErrorCode.BAD_INTEGER,
            header=header,
        )
    raise ProtocolError(
        f"{header}: {_quote(raw)} is not a canonical unsigned integer "
        "(ASCII digits only, no sign, no space, no leading zero)",
        code=ErrorCode.BAD_INTEGER,
        header=header,
    )
