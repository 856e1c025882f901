"""Whom a session serves (wire-2 §3.15): ``X-Meshnet-Client`` and
``X-Meshnet-Cache-Salt``.

A gateway serves many clients through one chain, and every node sees the
same sender (the stage above, the gateway). Two request headers, set only
by the chain (a node accepts nothing but the chain's token, §7), say what a
node cannot see for itself:

* ``X-Meshnet-Client`` — an opaque 32-hex name of the client (the gateway
  hashes its tenant, or its address): a node counts the per-client session
  quota (§3.9) by it instead of by the sender's address, and passes it on.
* ``X-Meshnet-Cache-Salt`` — 32 hex digits that start the chain of prefix
  block keys (§3.10): the first stage computes a chunk's keys from its
  token ids *and* this salt, so two tenants' equal prompts have unrelated
  keys and neither can attach, nor detect, the other's cached prefix.

Both are request-only: an answer never carries them.
"""

from __future__ import annotations

from typing import Any

from ._errors import ErrorCode, ProtocolError
from ._limits import Limits
from ._prefix import BLOCK_KEY

__all__ = ["parse_tenancy", "tenancy_pairs", "valid_tenancy_field"]

H_CLIENT = b"x-meshnet-client"
H_CACHE_SALT = b"x-meshnet-cache-salt"
# A block key's form (128 bits, 32 lowercase hex digits): one spelling each.
_NAME = BLOCK_KEY


def _parse(values: dict[bytes, bytes], header: bytes, code: ErrorCode) -> str | None:
    raw = values.get(header)
    if raw is None:
        return None
    if _NAME.fullmatch(raw) is None:
        raise ProtocolError(
            f"{header.decode()}: expected 32 lowercase hex digits",
            code=code,
            header=header.decode(),
        )
    return raw.decode("ascii")


def parse_tenancy(
    values: dict[bytes, bytes], fields: dict[str, Any], limits: Limits, sequencing: bool
) -> None:
    """The two tenancy headers (wire-2 §3.15), after every other group."""
    fields["client"] = _parse(values, H_CLIENT, ErrorCode.BAD_SESSION)
    fields["cache_salt"] = _parse(values, H_CACHE_SALT, ErrorCode.BAD_PREFIX)


def tenancy_pairs(client: str | None, cache_salt: str | None) -> list[tuple[bytes, bytes]]:
    pairs: list[tuple[bytes, bytes]] = []
    if client is not None:
        pairs.append((b"X-Meshnet-Client", client.encode("ascii")))
    if cache_salt is not None:
        pairs.append((b"X-Meshnet-Cache-Salt", cache_salt.encode("ascii")))
    return pairs


def valid_tenancy_field(value: object) -> bool:
    """For hand-built headers: None or 32 lowercase hex digits."""
    return value is None or (
        isinstance(value, str) and value.isascii() and _NAME.fullmatch(value.encode()) is not None
    )
