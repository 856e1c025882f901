"""The wire-2 header set (wire-2 §2): one immutable object, one strict parser.

``parse_wire_headers`` is the only place a peer's header values are turned
into numbers and tokens. It follows wire-2 §2's order of checks so that the
same bad request gets the same answer from every implementation: content
type (415) → duplicates (400) → wire version (400) → each value (400/415) →
tensor size (413). Every rejection names its header (lowercase) and code.

The value grammars and the per-group parsers are in ``_header_values``.
``WireHeaders`` built by hand validate themselves (``ValueError``: a bug in
our own code, not a peer's fault); the parser builds them through a private
path that skips re-validating what it has just checked.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._chunking import token_axis
from ._dtypes import WIRE_DTYPES, WIRE_ENCODINGS, wire_dtype_name
from ._header_values import (
    GROUPS,
    H_SESSION_KEY,
    KNOWN_MESHNET_HEADERS,
    MAX_RANK,
    OCTET_STREAM,
    SESSION_KEY,
    SESSION_RE,
    STAGE_RE,
    UINT_CEILING,
    WIRE_VERSION_VALUE,
    as_bytes,
    check_size,
    collect,
    duplicate,
    is_uint,
    optional_session_key,
)
from ._kv import kv_pairs, valid_kv_fields
from ._limits import Limits
from ._prefix import prefix_pairs, valid_prefix_fields
from ._sample import SampleSpec, sample_pairs, valid_sample_field
from ._slots import slot_setters
from ._tenancy import tenancy_pairs, valid_tenancy_field
from ._windows import (
    H_ACCEPTED,
    AfterSpec,
    checked_draft,
    parse_accepted,
    valid_accepted_field,
    valid_after_field,
    window_pairs,
)

__all__ = ["WireHeaders", "is_session_key", "parse_wire_headers", "parse_session_key"]

# What an answer's parse collects: X-Meshnet-Accepted is answer-only (wire-2 §3.16).
_ANSWER_HEADERS = KNOWN_MESHNET_HEADERS | {H_ACCEPTED}


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
    # wire-2 §3.10: the cached prefix a new session starts from, and the keys
    # of the blocks that end in this chunk.
    prefix: str | None = None
    prefix_blocks: tuple[str, ...] = ()
    # wire-2 §3.11: a KV hand-off message's checksum and its exporter's
    # identity fingerprint (on a KV export's answer and a KV import only).
    kv_checksum: str | None = None
    kv_fingerprint: str | None = None
    # wire-2 §3.13: the last stage draws the next token and answers its id
    # (request-only: an answer never carries it).
    sample: SampleSpec | None = None
    # wire-2 §3.15: whom the session serves (its quota's client) and the
    # salt of its prefix keys, set by the chain (request-only).
    client: str | None = None
    cache_salt: str | None = None
    # wire-2 §3.16: a verify window's drafted ids, and the session position
    # and epoch a chunk follows (request-only, but a KV export's answer
    # carries ``after``).
    draft: tuple[int, ...] | None = None
    after: AfterSpec | None = None
    # wire-2 §3.16: the drafts a window's answer accepted (answer-only: a
    # request's is never read, see parse_wire_headers' ``answer``).
    accepted: int | None = None

    def __post_init__(self) -> None:
        self._validate(_EVERY_CHECK)

    def _validate(self, names: Iterable[str]) -> None:
        """Check the fields ``names`` (each on its own) and the relations
        between fields; a ``ValueError`` names the first that is wrong."""
        for name in names:
            _CHECKS[name](self)
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
    def _trusted(cls, fields: dict[str, Any]) -> WireHeaders:
        """Build without validation: only for values the parser has checked."""
        self = object.__new__(cls)
        get = fields.get
        for set_slot, name, default in _SLOT_SETTERS:
            set_slot(self, get(name, default))
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
        # math.prod of Python ints is exact at any size.
        return math.prod(self.shape) * WIRE_DTYPES[self.dtype].itemsize

    @property
    def tokens(self) -> int:
        """Number of tokens: the size of the token axis (wire-2 §2)."""
        return self.shape[token_axis(self.shape)]

    @property
    def starts_session(self) -> bool:
        """The first chunk of a new session: nothing to replay before it
        (chunk index absent or 0, and position absent or 0 — or any, after
        the cached prefix the chunk names, wire-2 §3.10)."""
        return self.chunk_index in (None, 0) and (
            self.position in (None, 0) or self.prefix is not None
        )

    def replace(self, **changes: Any) -> WireHeaders:
        """A copy with ``changes`` applied, validated like a hand-built instance.

        Only the changed fields are checked again (and the relations between
        fields): the others were checked when this instance was built, and it
        is immutable. A node derives its answer's headers from the request's
        on every decode step (section decode), where usually nothing changes:
        a change to the value a field already holds (same types throughout)
        is no change, and with none this instance itself is the answer."""
        if type(self) is not WireHeaders:  # a subclass's own fields: the general way
            return dataclasses.replace(self, **changes)
        if not _NAMES.issuperset(changes):
            unknown = sorted(changes.keys() - _NAMES)
            raise TypeError(f"WireHeaders has no field {unknown[0]!r}")
        changed = [
            name
            for name, value in changes.items()
            # `is` first: most of a decode step's answer is the request's None
            if value is not (current := getattr(self, name)) and not _same(value, current)
        ]
        if not changed:
            return self
        new = object.__new__(WireHeaders)
        for set_slot, name, _ in _SLOT_SETTERS:  # as _trusted fills them
            set_slot(new, changes[name] if name in changed else getattr(self, name))
        new._validate(changed)
        return new

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
        if self.prefix is not None or self.prefix_blocks:
            pairs += prefix_pairs(self.prefix, self.prefix_blocks)
        if self.kv_checksum is not None or self.kv_fingerprint is not None:
            pairs += kv_pairs(self.kv_checksum, self.kv_fingerprint)
        if self.sample is not None:
            pairs += sample_pairs(self.sample)
        if self.client is not None or self.cache_salt is not None:
            pairs += tenancy_pairs(self.client, self.cache_salt)
        if self.draft is not None or self.after is not None or self.accepted is not None:
            pairs += window_pairs(self.draft, self.after, self.accepted)
        return pairs


def _same(value: Any, current: Any) -> bool:
    """``value`` (not the very object ``current``: `replace` tests that first)
    is what the field holds already: equal, and of the same types (``True``
    is not ``1``, a list not a tuple, ``np.int64(5)`` not ``5``: each of
    those is checked, and normalised or refused, as a change)."""
    kind = type(value)
    if kind is not type(current) or value != current:
        return False
    if kind is tuple:  # equal tuples: as long as each other, element by element
        for mine, theirs in zip(value, current, strict=True):
            if type(mine) is not type(theirs):
                return False
    return True


# (name, default) of every field, for WireHeaders._trusted: read once, not per parse.
_FIELDS: tuple[tuple[str, Any], ...] = tuple(
    (field.name, field.default) for field in dataclasses.fields(WireHeaders)
)
_NAMES: frozenset[str] = frozenset(name for name, _ in _FIELDS)
# (its slot's setter, name, default) of every field: a slot set directly, past
# the frozen class's __setattr__, is a third cheaper than object.__setattr__.
_SLOT_SETTERS: tuple[tuple[Callable[[Any, Any], None], str, Any], ...] = tuple(
    (set_slot, name, default)
    for set_slot, (name, default) in zip(
        slot_setters(WireHeaders, (name for name, _ in _FIELDS)), _FIELDS, strict=True
    )
)


def _check_shape(h: WireHeaders) -> None:
    # Accept any sequence of integer-likes for convenience (numpy shapes
    # hold Python ints already, but a list or np.int64 dims are common in
    # hand-built headers), and store the canonical tuple of Python ints.
    try:
        shape = tuple(operator.index(dim) for dim in h.shape)
    except TypeError:
        raise ValueError(f"shape must be a sequence of ints, got {h.shape!r}") from None
    if any(isinstance(dim, bool) for dim in h.shape):
        raise ValueError(f"shape must be a sequence of ints, got {h.shape!r}")
    object.__setattr__(h, "shape", shape)
    if not 1 <= len(shape) <= MAX_RANK:
        raise ValueError(f"shape must have 1 to {MAX_RANK} dimensions, got {shape!r}")
    if not all(1 <= dim < UINT_CEILING for dim in shape):
        raise ValueError(f"every dimension must be >= 1 (and < 10**19), got {shape!r}")


def _check_dtype(h: WireHeaders) -> None:
    if h.dtype not in WIRE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(WIRE_DTYPES)}, got {h.dtype!r}")


def _check_encoding(h: WireHeaders) -> None:
    if h.encoding not in WIRE_ENCODINGS:
        raise ValueError(f"encoding must be one of {sorted(WIRE_ENCODINGS)}, got {h.encoding!r}")


def _check_session(h: WireHeaders) -> None:
    if h.session is not None and (
        not isinstance(h.session, str)
        or not h.session.isascii()
        or SESSION_RE.fullmatch(h.session.encode("ascii")) is None
    ):
        raise ValueError(
            f"session must be a canonical lowercase 8-4-4-4-12 UUID, got {h.session!r}"
        )


def _check_stage(h: WireHeaders) -> None:
    if h.stage is not None and (
        not isinstance(h.stage, str)
        or not h.stage.isascii()
        or STAGE_RE.fullmatch(h.stage.encode("ascii")) is None
    ):
        raise ValueError(f"stage must be '<model-id>/<first layer>', got {h.stage!r}")


def _check_session_key(h: WireHeaders) -> None:
    if h.session_key is not None and not is_session_key(h.session_key):
        raise ValueError("session_key must be 32 lowercase hex digits")


def _check_prefix(h: WireHeaders) -> None:
    if not valid_prefix_fields(h.prefix, h.prefix_blocks):
        raise ValueError("prefix must be a block key or None, prefix_blocks a tuple of keys")


def _check_kv(h: WireHeaders) -> None:
    if not valid_kv_fields(h.kv_checksum, h.kv_fingerprint):
        raise ValueError("kv_checksum must be 16 and kv_fingerprint 32 lowercase hex digits")


def _check_sample(h: WireHeaders) -> None:
    if not valid_sample_field(h.sample):
        raise ValueError(f"sample must be a SampleSpec or None, got {h.sample!r}")


def _check_draft(h: WireHeaders) -> None:
    object.__setattr__(h, "draft", checked_draft(h.draft))  # a list of ids becomes a tuple


def _check_after(h: WireHeaders) -> None:
    if not valid_after_field(h.after):
        raise ValueError(f"after must be an AfterSpec or None, got {h.after!r}")


def _check_accepted(h: WireHeaders) -> None:
    if not valid_accepted_field(h.accepted):
        raise ValueError(f"accepted must be an int in 0..64 or None, got {h.accepted!r}")


def _tenancy_check(field: str) -> Callable[[WireHeaders], None]:
    def check(h: WireHeaders) -> None:
        if not valid_tenancy_field(getattr(h, field)):
            raise ValueError(f"{field} must be 32 lowercase hex digits or None")

    return check


def _uint_check(field: str) -> Callable[[WireHeaders], None]:
    def check(h: WireHeaders) -> None:
        value = getattr(h, field)
        if value is not None and not is_uint(value):
            raise ValueError(f"{field} must be an int in 0..10**19-1 or None, got {value!r}")

    return check


# Each field's own check, in the order __post_init__ runs them (its errors
# are what a hand-built instance has always raised first).
_CHECKS: dict[str, Callable[[WireHeaders], None]] = {
    "shape": _check_shape,
    "dtype": _check_dtype,
    "encoding": _check_encoding,
    "session": _check_session,
    "stage": _check_stage,
    "session_key": _check_session_key,
    "prefix": _check_prefix,
    "prefix_blocks": _check_prefix,
    "kv_checksum": _check_kv,
    "kv_fingerprint": _check_kv,
    "sample": _check_sample,
    "client": _tenancy_check("client"),
    "cache_salt": _tenancy_check("cache_salt"),
    "draft": _check_draft,
    "after": _check_after,
    "accepted": _check_accepted,
    **{
        name: _uint_check(name)
        for name in ("chunk_index", "chunk_total", "position", "deadline_ms")
    },
}
# One name per check (the prefix and KV pairs are checked together).
_EVERY_CHECK = tuple(n for n in _CHECKS if n not in ("prefix_blocks", "kv_fingerprint"))


def parse_wire_headers(
    pairs: Iterable[tuple[bytes | str, bytes | str]],
    *,
    limits: Limits = Limits(),  # noqa: B008 - Limits is frozen: sharing one is safe
    require_sequencing: bool = True,
    answer: bool = False,
) -> WireHeaders:
    """Validate a request's (or response's) wire headers, wire-2 §2.

    ``pairs`` are ``(name, value)`` as h11 gives them (bytes or str, names in
    any case). With ``require_sequencing=False`` (the gateway's input) the
    session, chunk index and chunk total may be absent; if given they must be
    valid, and a chunk index must be 0 and a total 1 (the client sends one
    whole sequence). With ``answer=True`` (a 200 to an activation) the
    answer-only ``X-Meshnet-Accepted`` is read too; a request's is ignored
    as an unknown header is. Raises ``ProtocolError`` with the wire-2 §2
    status, a stable code and the offending header.
    """
    values = collect(pairs, _ANSWER_HEADERS if answer else KNOWN_MESHNET_HEADERS)
    fields: dict[str, Any] = {}
    for group in GROUPS:  # wire-2 §2's order: see _header_values
        group(values, fields, limits, require_sequencing)
    parse_accepted(values, fields)  # absent from a request's values: None
    headers = WireHeaders._trusted(fields)
    # Python ints: 8 dimensions of 19 digits cannot overflow anything here,
    # and nothing has been allocated for the body yet.
    check_size(headers.shape, headers.dtype, headers.nbytes, limits)
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
    given = [as_bytes(v) for n, v in pairs if as_bytes(n).lower() == H_SESSION_KEY]
    if len(given) > 1:
        raise duplicate(H_SESSION_KEY, len(given))
    return optional_session_key(given[0] if given else None)
