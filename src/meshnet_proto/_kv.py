"""The KV hand-off message (wire-2 §3.11): its two headers and its shape.

A session's KV for a stage's layers travels as one wire-2 message of rank
6, ``[layers, 2, batch, kv_heads, positions, head_dim]``, exported by
``GET /kv/{session}`` and imported by ``POST /forward?kv=1``. Two headers
go with it and with nothing else: ``X-Meshnet-KV-Checksum`` (XXH3-64 of the
decoded tensor's bytes) and ``X-Meshnet-KV-Fingerprint`` (the exporter's
identity fingerprint, wire-2 §6.1). Their grammar is a header group of the
parse; which messages may carry them is ``check_kv_message``, called by the
server once it knows the request's query.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import xxhash

from ._errors import ErrorCode, ProtocolError
from ._limits import Limits

__all__ = ["KV_RANK", "check_kv_message", "is_kv_import", "kv_checksum"]

KV_RANK = 6  # [layers, 2, batch, kv_heads, positions, head_dim]
KV_DTYPES = frozenset({"float32", "float16", "bfloat16"})
H_KV_CHECKSUM = b"x-meshnet-kv-checksum"
H_KV_FINGERPRINT = b"x-meshnet-kv-fingerprint"
_CHECKSUM = re.compile(rb"[0-9a-f]{16}")
_FINGERPRINT = re.compile(rb"[0-9a-f]{32}")


def kv_checksum(tensor: np.ndarray) -> str:
    """XXH3-64 (seed 0) of the tensor's bytes, little-endian, as 16 hex digits."""
    data = np.ascontiguousarray(tensor)
    if data.dtype.byteorder == ">":
        data = data.astype(data.dtype.newbyteorder("<"))
    # Viewed as bytes: a buffer of float16 or bfloat16 has no format memoryview takes.
    return xxhash.xxh3_64_hexdigest(data.reshape(-1).view(np.uint8).data)


def is_kv_import(query: str) -> bool:
    """wire-2 §3.11: ``kv=1`` among the query's ``&``-separated parameters."""
    return "kv=1" in query.split("&")


def _bad(header: bytes, message: str) -> ProtocolError:
    return ProtocolError(message, code=ErrorCode.BAD_KV, header=header.decode("ascii"))


def parse_kv(
    values: dict[bytes, bytes], fields: dict[str, Any], limits: Limits, sequencing: bool
) -> None:
    """The two KV headers' grammar (whether the message may carry them is
    ``check_kv_message``: that needs the request's query)."""
    checksum, fingerprint = values.get(H_KV_CHECKSUM), values.get(H_KV_FINGERPRINT)
    if checksum is not None and _CHECKSUM.fullmatch(checksum) is None:
        raise _bad(H_KV_CHECKSUM, "x-meshnet-kv-checksum: not 16 lowercase hex digits (XXH3-64)")
    if fingerprint is not None and _FINGERPRINT.fullmatch(fingerprint) is None:
        raise _bad(H_KV_FINGERPRINT, "x-meshnet-kv-fingerprint: not 32 lowercase hex digits")
    fields["kv_checksum"] = None if checksum is None else checksum.decode("ascii")
    fields["kv_fingerprint"] = None if fingerprint is None else fingerprint.decode("ascii")


def check_kv_message(headers: Any, kv_import: bool) -> None:
    """400 ``bad_kv`` unless the KV headers are where wire-2 §3.11 puts them:
    on a KV import, both, with a KV-shaped tensor; on any other request, neither.

    ``headers`` is a ``WireHeaders`` (typed loosely: this module sits below it)."""
    if not kv_import:
        for value, header in (
            (headers.kv_checksum, H_KV_CHECKSUM),
            (headers.kv_fingerprint, H_KV_FINGERPRINT),
        ):
            if value is not None:
                raise _bad(
                    header, f"{header.decode()} belongs on a KV import only (POST /forward?kv=1)"
                )
        return
    for value, header in (
        (headers.kv_checksum, H_KV_CHECKSUM),
        (headers.kv_fingerprint, H_KV_FINGERPRINT),
    ):
        if value is None:
            raise _bad(header, f"a KV import must carry {header.decode()}")
    shape = headers.shape
    if len(shape) != KV_RANK or shape[1] != 2:
        raise _bad(
            b"x-meshnet-shape",
            "a KV import's shape is [layers, 2, batch, kv_heads, positions, head_dim]",
        )
    if headers.dtype not in KV_DTYPES:
        raise _bad(b"x-meshnet-dtype", f"a KV import's dtype is one of {sorted(KV_DTYPES)}")
    if headers.chunk_index != 0 or headers.chunk_total != 1:
        raise _bad(b"x-meshnet-chunk-index", "a KV import is a one-chunk run (index 0 of 1)")
    if headers.position != shape[4]:
        raise _bad(b"x-meshnet-position", f"a KV import's position is its positions ({shape[4]})")
    if headers.prefix is not None or headers.prefix_blocks:
        raise _bad(b"x-meshnet-prefix", "a KV import names no prefix")


def kv_pairs(checksum: str | None, fingerprint: str | None) -> list[tuple[bytes, bytes]]:
    pairs = []
    if checksum is not None:
        pairs.append((b"X-Meshnet-KV-Checksum", checksum.encode("ascii")))
    if fingerprint is not None:
        pairs.append((b"X-Meshnet-KV-Fingerprint", fingerprint.encode("ascii")))
    return pairs


def valid_kv_fields(checksum: object, fingerprint: object) -> bool:
    """For hand-built headers: each None or of its grammar."""

    def matches(value: object, grammar: re.Pattern[bytes]) -> bool:
        if value is None:
            return True
        return (
            isinstance(value, str)
            and value.isascii()
            and grammar.fullmatch(value.encode("ascii")) is not None
        )

    return matches(checksum, _CHECKSUM) and matches(fingerprint, _FINGERPRINT)
