"""The values of the wire-2 §2 headers: names, grammars, and one parser per
header group, each turning a peer's raw bytes into checked values or the
wire-2 error (status, stable code, the offending header).

``parse_wire_headers`` (``_headers``) drives them: it collects the header
values, then runs ``GROUPS`` in wire-2 §2's order of checks — wire version,
the tensor (shape, dtype, encoding), sequencing (session, chunk index and
total), the optional headers (position, deadline, session key, stage) — each
group writing its fields into one dict, so that the same bad request gets
the same answer from every implementation.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

from ._dtypes import WELL_FORMED_TOKEN, WIRE_DTYPES, WIRE_ENCODINGS
from ._errors import ErrorCode, ProtocolError
from ._integers import MAX_UINT_DIGITS, parse_canonical_uint
from ._kv import H_KV_CHECKSUM, H_KV_FINGERPRINT, parse_kv
from ._limits import Limits
from ._prefix import H_PREFIX, H_PREFIX_BLOCKS, parse_prefix
from ._sample import H_ALLOW, H_SAMPLE, parse_sample
from ._tenancy import H_CACHE_SALT, H_CLIENT, parse_tenancy
from ._windows import H_AFTER, H_DRAFT, parse_windows

# Header names as h11 hands them to us (lowercase bytes). Comparisons are done
# on ASCII-lowercased bytes only: ``str.lower()`` would turn the Kelvin sign
# (U+212A) into "k" and let "X-Meshnet-Chun\u212a-Index" through.
CONTENT_TYPE = b"content-type"
H_WIRE = b"x-meshnet-wire"
H_SHAPE = b"x-meshnet-shape"
H_DTYPE = b"x-meshnet-dtype"
H_SESSION = b"x-meshnet-session"
H_CHUNK_INDEX = b"x-meshnet-chunk-index"
H_CHUNK_TOTAL = b"x-meshnet-chunk-total"
H_ENCODING = b"x-meshnet-encoding"
H_POSITION = b"x-meshnet-position"
H_DEADLINE = b"x-meshnet-deadline-ms"
H_STAGE = b"x-meshnet-stage"
H_SESSION_KEY = b"x-meshnet-session-key"

KNOWN_MESHNET_HEADERS: frozenset[bytes] = frozenset(
    {
        H_WIRE,
        H_SHAPE,
        H_DTYPE,
        H_SESSION,
        H_CHUNK_INDEX,
        H_CHUNK_TOTAL,
        H_ENCODING,
        H_POSITION,
        H_DEADLINE,
        H_STAGE,
        H_SESSION_KEY,
        H_PREFIX,
        H_PREFIX_BLOCKS,
        H_KV_CHECKSUM,
        H_KV_FINGERPRINT,
        H_SAMPLE,
        H_ALLOW,
        H_DRAFT,
        H_AFTER,
        H_CLIENT,
        H_CACHE_SALT,
    }
)

OCTET_STREAM = b"application/octet-stream"
WIRE_VERSION_VALUE = b"2"

# wire-2 §2: 1..8 dimensions whatever a Limits says (Limits caps max_rank at 8).
MAX_RANK = 8
# Every integer we emit must be one we would parse back.
UINT_CEILING = 10**MAX_UINT_DIGITS

# Canonical lowercase 8-4-4-4-12 UUID, matched on ASCII bytes. uuid.UUID is
# not used: it accepts braces, "urn:uuid:", uppercase and missing hyphens,
# and two spellings of one session would be two sessions to a peer that
# compares strings.
SESSION_RE = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# X-Meshnet-Stage (wire-2 §2.3): ``model-id "/" uint``, the stage a sender
# expects to enter — the model id of its identity and the first layer.
# Bounded (64 + 1 + 19 bytes) and lowercase so one stage has one spelling.
STAGE_RE = re.compile(rb"[a-z0-9][a-z0-9._-]{0,63}/(?:0|[1-9][0-9]{0,18})")
# A session key (wire-2 §3.9): 128 random bits as 32 lowercase hex digits,
# one spelling only, so that comparing keys is comparing strings.
SESSION_KEY = re.compile(rb"[0-9a-f]{32}")
# Optional whitespace around a media type (RFC 9110 OWS).
_OWS = b" \t"
# Error messages quote at most this much of a rejected value.
_QUOTE_LIMIT = 40


def _quote(raw: bytes) -> str:
    shown = raw[:_QUOTE_LIMIT]
    return f"{shown!r}{'…' if len(raw) > _QUOTE_LIMIT else ''}"


def _name(header: bytes) -> str:
    return header.decode("ascii")


def as_bytes(item: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(item, str):
        # surrogatepass: a str from an odd source must become *some* bytes
        # (which will then fail validation) rather than a UnicodeError.
        return item.encode("utf-8", "surrogatepass")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    raise TypeError(f"header names and values are bytes or str, not {type(item).__name__}")


def is_uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < UINT_CEILING


def _check_content_type(values: list[bytes]) -> None:
    if len(values) == 1 and values[0] == OCTET_STREAM:
        return  # what every peer of ours sends: no stripping, no name
    header = _name(CONTENT_TYPE)
    if not values:
        raise ProtocolError(
            "Content-Type is missing; wire 2 bodies are application/octet-stream",
            code=ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            header=header,
        )
    if len(values) > 1:
        # Two media types for one body is ambiguous whichever they are; a
        # proxy might honour the other one.
        raise ProtocolError(
            f"Content-Type given {len(values)} times",
            code=ErrorCode.DUPLICATE_HEADER,
            header=header,
        )
    media_type = values[0].strip(_OWS).lower()
    if media_type == OCTET_STREAM:
        return
    if media_type.split(b";", 1)[0].strip(_OWS) == b"application/json":
        raise ProtocolError(
            "wire 1 is gone: this server speaks wire 2 only — send the tensor as raw "
            "little-endian bytes with Content-Type: application/octet-stream and "
            "X-Meshnet-Shape / X-Meshnet-Dtype headers (see wire-2 §2)",
            code=ErrorCode.WIRE1_GONE,
            header=header,
        )
    raise ProtocolError(
        f"Content-Type {_quote(values[0])} is not supported; wire 2 bodies are "
        "application/octet-stream (no parameters)",
        code=ErrorCode.UNSUPPORTED_MEDIA_TYPE,
        header=header,
    )


# Shapes parsed before, by their header's bytes: a session's decode steps
# all send the same one. Only valid, short values are kept, and few (a peer
# chooses the keys): at most _MEMO_ENTRIES of at most _MEMO_VALUE_BYTES
# each, then the memo starts over.
_MEMO_ENTRIES = 256
_MEMO_VALUE_BYTES = 64
_SHAPES: dict[bytes, tuple[int, ...]] = {}


def _parse_shape(value: bytes, *, max_rank: int) -> tuple[int, ...]:
    shape = _SHAPES.get(value)
    if shape is not None and len(shape) <= max_rank:
        return shape
    shape = _parse_new_shape(value, max_rank=max_rank)
    if len(value) <= _MEMO_VALUE_BYTES:
        if len(_SHAPES) >= _MEMO_ENTRIES:
            _SHAPES.clear()
        _SHAPES[value] = shape
    return shape


def _parse_new_shape(value: bytes, *, max_rank: int) -> tuple[int, ...]:
    # Count before splitting: a 16 KiB value of commas must not become a
    # list of thousands of empty strings.
    rank = value.count(b",") + 1
    if rank > max_rank:
        header = _name(H_SHAPE)
        raise ProtocolError(
            f"{header}: {rank} dimensions, at most {max_rank} allowed",
            code=ErrorCode.BAD_SHAPE,
            header=header,
        )
    dims: list[int] = []
    for part in value.split(b","):
        try:
            dim = parse_canonical_uint(part, header=H_SHAPE)
        except ProtocolError:
            header = _name(H_SHAPE)
            raise ProtocolError(
                f"{header}: {_quote(value)} is not a comma-separated list of canonical "
                "unsigned integers (e.g. 1,128,16384)",
                code=ErrorCode.BAD_SHAPE,
                header=header,
            ) from None
        if dim == 0:
            header = _name(H_SHAPE)
            raise ProtocolError(
                f"{header}: dimension {len(dims)} is 0; every dimension must be >= 1",
                code=ErrorCode.BAD_SHAPE,
                header=header,
            )
        dims.append(dim)
    return tuple(dims)


# The tokens a valid chunk may name (wire dtypes, encodings), as the parser
# returns them: a dict lookup instead of a regular expression, a decode and
# a set test per header. What is not one of them is refused below.
_KNOWN_TOKENS: dict[bytes, str] = {
    token.encode("ascii"): token for token in (*WIRE_DTYPES, *WIRE_ENCODINGS)
}


def _parse_token(
    value: bytes,
    *,
    header: bytes,
    supported: Iterable[str],
    what: str,
    bad: ErrorCode,
    unsupported: ErrorCode,
) -> str:
    """``value`` as one of ``supported`` (a subset of the known tokens), else
    400 ``bad`` (not a token at all) or 415 ``unsupported`` (well-formed)."""
    known = _KNOWN_TOKENS.get(value)
    if known is not None and known in supported:
        return known
    name = _name(header)
    if WELL_FORMED_TOKEN.fullmatch(value) is None:
        raise ProtocolError(
            f"{name}: {_quote(value)} is not a valid {what} token (lowercase, "
            f"e.g. {', '.join(sorted(supported))})",
            code=bad,
            header=name,
        )
    raise ProtocolError(
        f"{name}: {what} {value.decode('ascii')!r} is not supported (supported: "
        f"{', '.join(sorted(supported))})",
        code=unsupported,
        header=name,
    )


def _missing(header: bytes) -> ProtocolError:
    name = _name(header)
    return ProtocolError(
        f"required header {name} is missing", code=ErrorCode.MISSING_HEADER, header=name
    )


def duplicate(header: bytes, count: int) -> ProtocolError:
    name = _name(header)
    return ProtocolError(
        f"{name} given {count} times; each wire header may appear once",
        code=ErrorCode.DUPLICATE_HEADER,
        header=name,
    )


def optional_session_key(raw: bytes | None) -> str | None:
    """``X-Meshnet-Session-Key`` (wire-2 §2.3): absent, or 32 lowercase hex.

    The message never quotes the value: it is (meant to be) a secret.
    """
    if raw is None:
        return None
    if SESSION_KEY.fullmatch(raw) is None:
        name = _name(H_SESSION_KEY)
        raise ProtocolError(
            f"{name}: not 32 lowercase hex digits ({len(raw)} bytes given)",
            code=ErrorCode.BAD_SESSION_KEY,
            header=name,
        )
    return raw.decode("ascii")


def _optional_uint(values: dict[bytes, bytes], header: bytes, *, required: bool) -> int | None:
    raw = values.get(header)
    if raw is None:
        if required:
            raise _missing(header)
        return None
    return parse_canonical_uint(raw, header=header)


def _bad_chunk(header: bytes, message: str) -> ProtocolError:
    name = _name(header)
    return ProtocolError(f"{name}: {message}", code=ErrorCode.BAD_CHUNK_INDEX, header=name)


# --------------------------------------------------------------------------
# The groups, in wire-2 §2's order of checks
# --------------------------------------------------------------------------

# A group parser reads the collected values and writes its fields.
Group: TypeAlias = Callable[[dict[bytes, bytes], dict[str, Any], Limits, bool], None]


def collect(
    pairs: Iterable[tuple[bytes | str, bytes | str]],
    known: frozenset[bytes] = KNOWN_MESHNET_HEADERS,
) -> dict[bytes, bytes]:
    """The ``known`` wire headers' values, after the content type (415) and
    duplicates (400) are checked; every other header is ignored."""
    content_types: list[bytes] = []
    found: dict[bytes, bytes] = {}
    # How often each header given more than once was given (rare: an error).
    repeated: dict[bytes, int] = {}
    for raw_name, raw_value in pairs:
        # h11 hands bytes over: skip the conversion calls then (a decode
        # step parses a dozen headers; section decode).
        if type(raw_name) is bytes and type(raw_value) is bytes:
            name, value = raw_name.lower(), raw_value
        else:
            name, value = as_bytes(raw_name).lower(), as_bytes(raw_value)
        if name == CONTENT_TYPE:
            content_types.append(value)
        elif name in known:
            if name in found:
                repeated[name] = repeated.get(name, 1) + 1
            else:
                found[name] = value
        # Anything else, including unknown X-Meshnet-* headers, is ignored:
        # forward compatibility (wire-2 §2).

    _check_content_type(content_types)

    # Duplicates are checked over the known headers in a fixed order so the
    # answer does not depend on the order the peer happened to send them in:
    # the first in sorted order is named.
    if repeated:
        header = min(repeated)
        raise duplicate(header, repeated[header])
    return found


def _wire_version(
    values: dict[bytes, bytes], fields: dict[str, Any], limits: Limits, sequencing: bool
) -> None:
    wire = values.get(H_WIRE)
    if wire is not None and wire != WIRE_VERSION_VALUE:
        raise ProtocolError(
            f"x-meshnet-wire: {_quote(wire)}; this server speaks wire 2 only",
            code=ErrorCode.WIRE_VERSION_MISMATCH,
            header=_name(H_WIRE),
        )


def _tensor(
    values: dict[bytes, bytes], fields: dict[str, Any], limits: Limits, sequencing: bool
) -> None:
    """Shape, dtype and encoding: what the body is."""
    raw_shape = values.get(H_SHAPE)
    if raw_shape is None:
        raise _missing(H_SHAPE)
    fields["shape"] = _parse_shape(raw_shape, max_rank=limits.max_rank)

    raw_dtype = values.get(H_DTYPE)
    if raw_dtype is None:
        raise _missing(H_DTYPE)
    fields["dtype"] = _parse_token(
        raw_dtype,
        header=H_DTYPE,
        supported=WIRE_DTYPES,
        what="dtype",
        bad=ErrorCode.BAD_DTYPE,
        unsupported=ErrorCode.UNSUPPORTED_DTYPE,
    )

    raw_encoding = values.get(H_ENCODING)
    encoding = "identity"
    if raw_encoding is not None:
        encoding = _parse_token(
            raw_encoding,
            header=H_ENCODING,
            supported=WIRE_ENCODINGS,
            what="encoding",
            bad=ErrorCode.BAD_ENCODING,
            unsupported=ErrorCode.UNSUPPORTED_ENCODING,
        )
    fields["encoding"] = encoding


def _sequencing(
    values: dict[bytes, bytes], fields: dict[str, Any], limits: Limits, required: bool
) -> None:
    """Session, chunk index and chunk total: where the tensor falls. Without
    ``required`` (the gateway's input) they may be absent, and a given index
    must be 0 and a total 1 (the client sends one whole sequence)."""
    session: str | None = None
    raw_session = values.get(H_SESSION)
    if raw_session is None:
        if required:
            raise _missing(H_SESSION)
    elif SESSION_RE.fullmatch(raw_session) is None:
        raise ProtocolError(
            f"x-meshnet-session: {_quote(raw_session)} is not a canonical lowercase "
            "8-4-4-4-12 UUID",
            code=ErrorCode.BAD_SESSION,
            header=_name(H_SESSION),
        )
    else:
        session = raw_session.decode("ascii")
    fields["session"] = session

    chunk_index = _optional_uint(values, H_CHUNK_INDEX, required=required)
    chunk_total = _optional_uint(values, H_CHUNK_TOTAL, required=required)
    if chunk_total is not None:
        if chunk_total < 1:
            raise _bad_chunk(H_CHUNK_TOTAL, "chunk total is 0; a run has at least one chunk")
        if chunk_total > limits.max_chunk_total:
            raise _bad_chunk(
                H_CHUNK_TOTAL,
                f"chunk total {chunk_total} is over this node's limit of {limits.max_chunk_total}",
            )
        if not required and chunk_total != 1:
            raise _bad_chunk(
                H_CHUNK_TOTAL,
                f"chunk total {chunk_total}: send the whole sequence in one request "
                "(total 1); the gateway does the chunking",
            )
    if chunk_index is not None:
        if chunk_total is not None and chunk_index >= chunk_total:
            raise _bad_chunk(
                H_CHUNK_INDEX, f"chunk index {chunk_index} is not below the total {chunk_total}"
            )
        if not required and chunk_index != 0:
            raise _bad_chunk(
                H_CHUNK_INDEX,
                f"chunk index {chunk_index}: send the whole sequence in one request "
                "(index 0); the gateway does the chunking",
            )
    fields["chunk_index"] = chunk_index
    fields["chunk_total"] = chunk_total


def _optional(
    values: dict[bytes, bytes], fields: dict[str, Any], limits: Limits, sequencing: bool
) -> None:
    """Position, deadline, session key and stage: each absent or well-formed."""
    fields["position"] = _optional_uint(values, H_POSITION, required=False)
    fields["deadline_ms"] = _optional_uint(values, H_DEADLINE, required=False)
    fields["session_key"] = optional_session_key(values.get(H_SESSION_KEY))

    stage: str | None = None
    raw_stage = values.get(H_STAGE)
    if raw_stage is not None:
        if STAGE_RE.fullmatch(raw_stage) is None:
            raise ProtocolError(
                f"x-meshnet-stage: {_quote(raw_stage)} is not '<model-id>/<first layer>' "
                "(model id: 1-64 of a-z 0-9 . _ -, starting with a letter or digit; "
                "layer: a canonical unsigned integer)",
                code=ErrorCode.BAD_STAGE,
                header=_name(H_STAGE),
            )
        stage = raw_stage.decode("ascii")
    fields["stage"] = stage


# wire-2 §2's order of checks, after the content type and duplicates (collect)
# and before the tensor's size (parse_wire_headers, once the headers are built).
GROUPS: tuple[Group, ...] = (
    _wire_version,
    _tensor,
    _sequencing,
    _optional,
    parse_prefix,
    parse_kv,
    parse_sample,
    parse_windows,
    parse_tenancy,
)


def check_size(shape: tuple[int, ...], dtype: str, nbytes: int, limits: Limits) -> None:
    """413 for a tensor over ``limits.max_tensor_bytes``."""
    if nbytes > limits.max_tensor_bytes:
        raise ProtocolError(
            f"tensor of shape {','.join(map(str, shape))} {dtype} is {nbytes} bytes, over "
            f"this node's limit of {limits.max_tensor_bytes} bytes",
            code=ErrorCode.TENSOR_TOO_LARGE,
            header=_name(H_SHAPE),
        )
