"""The wire-2 header set (wire-2 §2): one immutable object, one strict parser.

``parse_wire_headers`` is the only place a peer's header values are turned
into numbers and tokens. It follows wire-2 §2's order of checks so that the
same bad request gets the same answer from every implementation: content
type (415) → duplicates (400) → wire version (400) → each value (400/415) →
tensor size (413). Every rejection names its header (lowercase) and code.

``WireHeaders`` built by hand validate themselves (``ValueError``: a bug in
our own code, not a peer's fault); the parser builds them through a private
path that skips re-validating what it has just checked.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._chunking import token_axis
from ._dtypes import WELL_FORMED_TOKEN, WIRE_DTYPES, WIRE_ENCODINGS, wire_dtype_name
from ._errors import ProtocolError
from ._integers import MAX_UINT_DIGITS, parse_canonical_uint
from ._limits import Limits

__all__ = ["WireHeaders", "is_session_key", "parse_wire_headers", "parse_session_key"]

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
    }
)

OCTET_STREAM = b"application/octet-stream"
WIRE_VERSION_VALUE = b"2"

# wire-2 §2: 1..8 dimensions whatever a Limits says (Limits caps max_rank at 8).
MAX_RANK = 8
# Every integer we emit must be one we would parse back.
_UINT_CEILING = 10**MAX_UINT_DIGITS

# Canonical lowercase 8-4-4-4-12 UUID, matched on ASCII bytes. uuid.UUID is
# not used: it accepts braces, "urn:uuid:", uppercase and missing hyphens,
# and two spellings of one session would be two sessions to a peer that
# compares strings.
_SESSION = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# X-Meshnet-Stage (wire-2 §2.3): ``model-id "/" uint``, the stage a sender
# expects to enter — the model id of its identity and the first layer.
# Bounded (64 + 1 + 19 bytes) and lowercase so one stage has one spelling.
_STAGE = re.compile(rb"[a-z0-9][a-z0-9._-]{0,63}/(?:0|[1-9][0-9]{0,18})")
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


def _as_bytes(item: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(item, str):
        # surrogatepass: a str from an odd source must become *some* bytes
        # (which will then fail validation) rather than a UnicodeError.
        return item.encode("utf-8", "surrogatepass")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    raise TypeError(f"header names and values are bytes or str, not {type(item).__name__}")


def _is_uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _UINT_CEILING


@dataclass(frozen=True, slots=True, kw_only=True)
class WireHeaders:
    """The wire-2 §2 header set of one tensor message (request or 200 response).

    ``shape`` and ``dtype`` describe the tensor; ``session``, ``chunk_index``
    and ``chunk_total`` place it in a run (optional only on the gateway's
    input); ``encoding`` is the body's (``identity`` or ``zstd``);
    ``position``, ``deadline_ms`` and ``stage`` (``"<model>/<first layer>"``,
    request-only) are optional. ``session_key`` is the session's secret
    (wire-2 §3.9), sent on requests only: never on an answer.
    """

    shape: tuple[int, ...]
    dtype: str
    session: str | None = None
    chunk_index: int | None = None
    chunk_total: int | None = None
    encoding: str = "identity"
    position: int | None = None
    deadline_ms: int | None = None
    stage: str | None = None
    session_key: str | None = None

    def __post_init__(self) -> None:
        # Accept any sequence of integer-likes for convenience (numpy shapes
        # hold Python ints already, but a list or np.int64 dims are common in
        # hand-built headers), and store the canonical tuple of Python ints.
        try:
            shape = tuple(operator.index(dim) for dim in self.shape)
        except TypeError:
            raise ValueError(f"shape must be a sequence of ints, got {self.shape!r}") from None
        if any(isinstance(dim, bool) for dim in self.shape):
            raise ValueError(f"shape must be a sequence of ints, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        if not 1 <= len(shape) <= MAX_RANK:
            raise ValueError(f"shape must have 1 to {MAX_RANK} dimensions, got {shape!r}")
        if not all(1 <= dim < _UINT_CEILING for dim in shape):
            raise ValueError(f"every dimension must be >= 1 (and < 10**19), got {shape!r}")
        if self.dtype not in WIRE_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(WIRE_DTYPES)}, got {self.dtype!r}")
        if self.encoding not in WIRE_ENCODINGS:
            raise ValueError(
                f"encoding must be one of {sorted(WIRE_ENCODINGS)}, got {self.encoding!r}"
            )
        if self.session is not None and (
            not isinstance(self.session, str)
            or not self.session.isascii()
            or _SESSION.fullmatch(self.session.encode("ascii")) is None
        ):
            raise ValueError(
                f"session must be a canonical lowercase 8-4-4-4-12 UUID, got {self.session!r}"
            )
        if self.stage is not None and (
            not isinstance(self.stage, str)
            or not self.stage.isascii()
            or _STAGE.fullmatch(self.stage.encode("ascii")) is None
        ):
            raise ValueError(f"stage must be '<model-id>/<first layer>', got {self.stage!r}")
        if self.session_key is not None and not is_session_key(self.session_key):
            raise ValueError("session_key must be 32 lowercase hex digits")
        for field in ("chunk_index", "chunk_total", "position", "deadline_ms"):
            value = getattr(self, field)
            if value is not None and not _is_uint(value):
                raise ValueError(f"{field} must be an int in 0..10**19-1 or None, got {value!r}")
        if self.chunk_total is not None and self.chunk_total < 1:
            raise ValueError(f"chunk_total must be >= 1, got {self.chunk_total}")
        if (
            self.chunk_index is not None
            and self.chunk_total is not None
            and self.chunk_index >= self.chunk_total
        ):
            raise ValueError(
                f"chunk_index must be < chunk_total, got {self.chunk_index} of {self.chunk_total}"
            )

    @classmethod
    def _trusted(cls, **fields: Any) -> WireHeaders:
        """Build without validation: only for values the parser has checked."""
        self = object.__new__(cls)
        for field in dataclasses.fields(cls):
            object.__setattr__(self, field.name, fields.get(field.name, field.default))
        return self

    @classmethod
    def for_array(cls, array: np.ndarray, **fields: Any) -> WireHeaders:
        """Headers describing ``array`` (its shape and wire dtype) plus ``fields``.

        Raises ``ValueError`` when the array's dtype is not a wire dtype.
        """
        return cls(shape=tuple(array.shape), dtype=wire_dtype_name(array.dtype), **fields)

    @property
    def numpy_dtype(self) -> np.dtype:
        """The little-endian numpy dtype of the body's elements."""
        return WIRE_DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Decoded tensor size in bytes, computed with Python ints (never overflows)."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count * WIRE_DTYPES[self.dtype].itemsize

    @property
    def tokens(self) -> int:
        """Number of tokens: the size of the token axis (wire-2 §2)."""
        return self.shape[token_axis(self.shape)]

    def replace(self, **changes: Any) -> WireHeaders:
        """A copy with ``changes`` applied, validated like a hand-built instance."""
        return dataclasses.replace(self, **changes)

    def to_pairs(self) -> list[tuple[bytes, bytes]]:
        """The header pairs to send, canonically formatted.

        Content-Type and ``X-Meshnet-Wire: 2`` first, then every field that is
        set (encoding always, even ``identity``: explicit is cheaper to debug
        than a default). Names are in wire-2 §2's spelling; HTTP names are
        case-insensitive and h11 lowercases them on receipt. Content-Length
        is the connection's business (it knows the body), so it is not here.
        """
        pairs: list[tuple[bytes, bytes]] = [
            (b"Content-Type", OCTET_STREAM),
            (b"X-Meshnet-Wire", WIRE_VERSION_VALUE),
            (b"X-Meshnet-Shape", ",".join(map(str, self.shape)).encode("ascii")),
            (b"X-Meshnet-Dtype", self.dtype.encode("ascii")),
        ]
        if self.session is not None:
            pairs.append((b"X-Meshnet-Session", self.session.encode("ascii")))
        if self.chunk_index is not None:
            pairs.append((b"X-Meshnet-Chunk-Index", str(self.chunk_index).encode("ascii")))
        if self.chunk_total is not None:
            pairs.append((b"X-Meshnet-Chunk-Total", str(self.chunk_total).encode("ascii")))
        pairs.append((b"X-Meshnet-Encoding", self.encoding.encode("ascii")))
        if self.position is not None:
            pairs.append((b"X-Meshnet-Position", str(self.position).encode("ascii")))
        if self.deadline_ms is not None:
            pairs.append((b"X-Meshnet-Deadline-Ms", str(self.deadline_ms).encode("ascii")))
        if self.stage is not None:
            pairs.append((b"X-Meshnet-Stage", self.stage.encode("ascii")))
        if self.session_key is not None:
            pairs.append((b"X-Meshnet-Session-Key", self.session_key.encode("ascii")))
        return pairs


# --------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------


def _check_content_type(values: list[bytes]) -> None:
    header = _name(CONTENT_TYPE)
    if not values:
        raise ProtocolError(
            "Content-Type is missing; wire 2 bodies are application/octet-stream",
            code="unsupported_media_type",
            status=415,
            header=header,
        )
    if len(values) > 1:
        # Two media types for one body is ambiguous whichever they are; a
        # proxy might honour the other one.
        raise ProtocolError(
            f"Content-Type given {len(values)} times",
            code="duplicate_header",
            status=400,
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
            code="wire1_gone",
            status=415,
            header=header,
        )
    raise ProtocolError(
        f"Content-Type {_quote(values[0])} is not supported; wire 2 bodies are "
        "application/octet-stream (no parameters)",
        code="unsupported_media_type",
        status=415,
        header=header,
    )


def _parse_shape(value: bytes, *, max_rank: int) -> tuple[int, ...]:
    header = _name(H_SHAPE)
    # Count before splitting: a 16 KiB value of commas must not become a
    # list of thousands of empty strings.
    rank = value.count(b",") + 1
    if rank > max_rank:
        raise ProtocolError(
            f"{header}: {rank} dimensions, at most {max_rank} allowed",
            code="bad_shape",
            status=400,
            header=header,
        )
    dims: list[int] = []
    for part in value.split(b","):
        try:
            dim = parse_canonical_uint(part, header=header)
        except ProtocolError:
            raise ProtocolError(
                f"{header}: {_quote(value)} is not a comma-separated list of canonical "
                "unsigned integers (e.g. 1,128,16384)",
                code="bad_shape",
                status=400,
                header=header,
            ) from None
        if dim == 0:
            raise ProtocolError(
                f"{header}: dimension {len(dims)} is 0; every dimension must be >= 1",
                code="bad_shape",
                status=400,
                header=header,
            )
        dims.append(dim)
    return tuple(dims)


def _parse_token(
    value: bytes, *, header: bytes, supported: Iterable[str], what: str, bad: str, unsupported: str
) -> str:
    name = _name(header)
    if WELL_FORMED_TOKEN.fullmatch(value) is None:
        raise ProtocolError(
            f"{name}: {_quote(value)} is not a valid {what} token (lowercase, "
            f"e.g. {', '.join(sorted(supported))})",
            code=bad,
            status=400,
            header=name,
        )
    token = value.decode("ascii")
    if token not in supported:
        raise ProtocolError(
            f"{name}: {what} {token!r} is not supported (supported: "
            f"{', '.join(sorted(supported))})",
            code=unsupported,
            status=415,
            header=name,
        )
    return token


def _missing(header: bytes) -> ProtocolError:
    name = _name(header)
    return ProtocolError(
        f"required header {name} is missing", code="missing_header", status=400, header=name
    )


def parse_wire_headers(
    pairs: Iterable[tuple[bytes | str, bytes | str]],
    *,
    limits: Limits = Limits(),  # noqa: B008 - Limits is frozen: sharing one is safe
    require_sequencing: bool = True,
) -> WireHeaders:
    """Validate a request's (or response's) wire headers, wire-2 §2.

    ``pairs`` are ``(name, value)`` as h11 gives them (bytes or str, names in
    any case). With ``require_sequencing=False`` (the gateway's input) the
    session, chunk index and chunk total may be absent; if given they must be
    valid, and a chunk index must be 0 and a total 1 (the client sends one
    whole sequence). Raises ``ProtocolError`` with the wire-2 §2 status, a
    stable code and the offending header.
    """
    content_types: list[bytes] = []
    found: dict[bytes, list[bytes]] = {}
    for raw_name, raw_value in pairs:
        name = _as_bytes(raw_name).lower()
        value = _as_bytes(raw_value)
        if name == CONTENT_TYPE:
            content_types.append(value)
        elif name in KNOWN_MESHNET_HEADERS:
            found.setdefault(name, []).append(value)
        # Anything else, including unknown X-Meshnet-* headers, is ignored:
        # forward compatibility (wire-2 §2).

    _check_content_type(content_types)

    # Duplicates are checked over the known headers in a fixed order so the
    # answer does not depend on the order the peer happened to send them in.
    for header in sorted(found):
        if len(found[header]) > 1:
            raise _duplicate(header, len(found[header]))
    values = {header: given[0] for header, given in found.items()}

    wire = values.get(H_WIRE)
    if wire is not None and wire != WIRE_VERSION_VALUE:
        raise ProtocolError(
            f"x-meshnet-wire: {_quote(wire)}; this server speaks wire 2 only",
            code="wire_version_mismatch",
            status=400,
            header=_name(H_WIRE),
        )

    raw_shape = values.get(H_SHAPE)
    if raw_shape is None:
        raise _missing(H_SHAPE)
    shape = _parse_shape(raw_shape, max_rank=limits.max_rank)

    raw_dtype = values.get(H_DTYPE)
    if raw_dtype is None:
        raise _missing(H_DTYPE)
    dtype = _parse_token(
        raw_dtype,
        header=H_DTYPE,
        supported=WIRE_DTYPES,
        what="dtype",
        bad="bad_dtype",
        unsupported="unsupported_dtype",
    )

    raw_encoding = values.get(H_ENCODING)
    encoding = "identity"
    if raw_encoding is not None:
        encoding = _parse_token(
            raw_encoding,
            header=H_ENCODING,
            supported=WIRE_ENCODINGS,
            what="encoding",
            bad="bad_encoding",
            unsupported="unsupported_encoding",
        )

    session: str | None = None
    raw_session = values.get(H_SESSION)
    if raw_session is None:
        if require_sequencing:
            raise _missing(H_SESSION)
    elif _SESSION.fullmatch(raw_session) is None:
        raise ProtocolError(
            f"x-meshnet-session: {_quote(raw_session)} is not a canonical lowercase "
            "8-4-4-4-12 UUID",
            code="bad_session",
            status=400,
            header=_name(H_SESSION),
        )
    else:
        session = raw_session.decode("ascii")

    chunk_index = _optional_uint(values, H_CHUNK_INDEX, required=require_sequencing)
    chunk_total = _optional_uint(values, H_CHUNK_TOTAL, required=require_sequencing)
    if chunk_total is not None:
        if chunk_total < 1:
            raise _bad_chunk(H_CHUNK_TOTAL, "chunk total is 0; a run has at least one chunk")
        if chunk_total > limits.max_chunk_total:
            raise _bad_chunk(
                H_CHUNK_TOTAL,
                f"chunk total {chunk_total} is over this node's limit of {limits.max_chunk_total}",
            )
        if not require_sequencing and chunk_total != 1:
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
        if not require_sequencing and chunk_index != 0:
            raise _bad_chunk(
                H_CHUNK_INDEX,
                f"chunk index {chunk_index}: send the whole sequence in one request "
                "(index 0); the gateway does the chunking",
            )

    position = _optional_uint(values, H_POSITION, required=False)
    deadline_ms = _optional_uint(values, H_DEADLINE, required=False)
    session_key = _optional_session_key(values.get(H_SESSION_KEY))

    stage: str | None = None
    raw_stage = values.get(H_STAGE)
    if raw_stage is not None:
        if _STAGE.fullmatch(raw_stage) is None:
            raise ProtocolError(
                f"x-meshnet-stage: {_quote(raw_stage)} is not '<model-id>/<first layer>' "
                "(model id: 1-64 of a-z 0-9 . _ -, starting with a letter or digit; "
                "layer: a canonical unsigned integer)",
                code="bad_stage",
                status=400,
                header=_name(H_STAGE),
            )
        stage = raw_stage.decode("ascii")

    headers = WireHeaders._trusted(
        shape=shape,
        dtype=dtype,
        session=session,
        chunk_index=chunk_index,
        chunk_total=chunk_total,
        encoding=encoding,
        position=position,
        deadline_ms=deadline_ms,
        stage=stage,
        session_key=session_key,
    )
    # Python ints: 8 dimensions of 19 digits cannot overflow anything here,
    # and nothing has been allocated for the body yet.
    nbytes = headers.nbytes
    if nbytes > limits.max_tensor_bytes:
        raise ProtocolError(
            f"tensor of shape {','.join(map(str, shape))} {dtype} is {nbytes} bytes, over "
            f"this node's limit of {limits.max_tensor_bytes} bytes",
            code="tensor_too_large",
            status=413,
            header=_name(H_SHAPE),
        )
    return headers


def is_session_key(value: object) -> bool:
    """Whether ``value`` is a well-formed session key (a str of 32 lowercase hex)."""
    return (
        isinstance(value, str)
        and value.isascii()
        and SESSION_KEY.fullmatch(value.encode("ascii")) is not None
    )


def parse_session_key(pairs: Iterable[tuple[bytes | str, bytes | str]]) -> str | None:
    """The ``X-Meshnet-Session-Key`` of a request that is not an activation
    (``DELETE /sessions/{id}``): absent, or well-formed; given twice is 400
    ``duplicate_header`` as for an activation."""
    given = [_as_bytes(v) for n, v in pairs if _as_bytes(n).lower() == H_SESSION_KEY]
    if len(given) > 1:
        raise _duplicate(H_SESSION_KEY, len(given))
    return _optional_session_key(given[0] if given else None)


def _duplicate(header: bytes, count: int) -> ProtocolError:
    name = _name(header)
    return ProtocolError(
        f"{name} given {count} times; each wire header may appear once",
        code="duplicate_header",
        status=400,
        header=name,
    )


def _optional_session_key(raw: bytes | None) -> str | None:
    """``X-Meshnet-Session-Key`` (wire-2 §2.3): absent, or 32 lowercase hex.

    The message never quotes the value: it is (meant to be) a secret.
    """
    if raw is None:
        return None
    if SESSION_KEY.fullmatch(raw) is None:
        name = _name(H_SESSION_KEY)
        raise ProtocolError(
            f"{name}: not 32 lowercase hex digits ({len(raw)} bytes given)",
            code="bad_session_key",
            status=400,
            header=name,
        )
    return raw.decode("ascii")


def _optional_uint(values: dict[bytes, bytes], header: bytes, *, required: bool) -> int | None:
    raw = values.get(header)
    if raw is None:
        if required:
            raise _missing(header)
        return None
    return parse_canonical_uint(raw, header=_name(header))


def _bad_chunk(header: bytes, message: str) -> ProtocolError:
    name = _name(header)
    return ProtocolError(f"{name}: {message}", code="bad_chunk_index", status=400, header=name)
