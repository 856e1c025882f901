"""Prefix-cache identities (wire-2 §3.10): block keys and their two headers.

A session's tokens are cut into blocks of ``PREFIX_BLOCK_TOKENS``; block
``i``'s key is BLAKE2b-128 over the previous block's key (none for block 0)
and the block's token ids as int32 little-endian. The key of block ``i``
thus names the whole prefix ``[0, 32·(i+1))``, so every stage can file its
own layers' KV under the same name although only the first stage sees the
token ids. The hash is pure computation: no state, no I/O.

``X-Meshnet-Prefix-Blocks`` carries the keys of the blocks that end inside
a chunk (exactly as many as end there: a count the head alone decides);
``X-Meshnet-Prefix`` on a new session's first chunk names the cached prefix
the session starts from (its position is that prefix's length).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._errors import ErrorCode, ProtocolError
from ._limits import Limits

__all__ = [
    "PREFIX_BLOCK_TOKENS",
    "blocks_ending_in",
    "prefix_block_keys",
]

PREFIX_BLOCK_TOKENS = 32
H_PREFIX = b"x-meshnet-prefix"
H_PREFIX_BLOCKS = b"x-meshnet-prefix-blocks"
BLOCK_KEY = re.compile(rb"[0-9a-f]{32}")
_BLOCK_LIST = re.compile(rb"[0-9a-f]{32}(?:,[0-9a-f]{32})*")


def prefix_block_keys(
    tokens: Sequence[int] | np.ndarray, previous: str | None = None, *, salt: str | None = None
) -> list[str]:
    """The keys of the whole blocks of ``tokens``, chained after ``previous``
    (the key of the block before ``tokens[0]``; None at position 0). A
    trailing partial block has no key yet. ``salt`` (32 hex digits, wire-2
    §3.15) keys block 0's hash — BLAKE2b's own keyed mode, so a salted key
    is unrelated to every unsalted one and to every other salt's; the
    blocks after it chain from a key that already carries it."""
    ids = np.ascontiguousarray(np.asarray(tokens, dtype="<i4").reshape(-1))
    keys: list[str] = []
    chain = bytes.fromhex(previous) if previous is not None else b""
    mac = bytes.fromhex(salt) if salt is not None and previous is None else b""
    for start in range(0, len(ids) - PREFIX_BLOCK_TOKENS + 1, PREFIX_BLOCK_TOKENS):
        block = ids[start : start + PREFIX_BLOCK_TOKENS].tobytes()
        chain = hashlib.blake2b(chain + block, digest_size=16, key=mac).digest()
        mac = b""
        keys.append(chain.hex())
    return keys


def blocks_ending_in(position: int, tokens: int) -> int:
    """How many blocks end inside the chunk ``[position, position + tokens)``."""
    return (position + tokens) // PREFIX_BLOCK_TOKENS - position // PREFIX_BLOCK_TOKENS


def _bad(header: bytes, message: str) -> ProtocolError:
    return ProtocolError(message, code=ErrorCode.BAD_PREFIX, header=header.decode("ascii"))


def parse_prefix(
    values: dict[bytes, bytes], fields: dict[str, Any], limits: Limits, sequencing: bool
) -> None:
    """The two prefix headers (wire-2 §3.10), after every other group: their
    checks need the shape, the chunk index and the position."""
    raw_prefix, raw_blocks = values.get(H_PREFIX), values.get(H_PREFIX_BLOCKS)
    fields["prefix"], fields["prefix_blocks"] = None, ()
    if raw_prefix is None and raw_blocks is None:
        return
    shape = fields["shape"]
    if len(shape) >= 2 and shape[0] != 1:
        raise _bad(
            (raw_blocks is None and H_PREFIX) or H_PREFIX_BLOCKS,
            f"prefix caching is for batch 1; this chunk has batch {shape[0]}",
        )
    position = fields["position"] or 0
    if raw_prefix is not None:
        if BLOCK_KEY.fullmatch(raw_prefix) is None:
            raise _bad(H_PREFIX, "x-meshnet-prefix: not a block key (32 lowercase hex digits)")
        if fields["chunk_index"] != 0 or not position or position % PREFIX_BLOCK_TOKENS:
            raise _bad(
                H_PREFIX,
                "x-meshnet-prefix belongs on a new session's chunk 0, at a position that is "
                f"a positive multiple of {PREFIX_BLOCK_TOKENS}",
            )
        fields["prefix"] = raw_prefix.decode("ascii")
    if raw_blocks is not None:
        tokens = shape[1] if len(shape) >= 2 else shape[0]
        expected = blocks_ending_in(position, tokens)
        if _BLOCK_LIST.fullmatch(raw_blocks) is None or (len(raw_blocks) + 1) // 33 != expected:
            raise _bad(
                H_PREFIX_BLOCKS,
                f"x-meshnet-prefix-blocks: expected {expected} comma-separated block keys "
                "(the blocks that end in this chunk)",
            )
        fields["prefix_blocks"] = tuple(raw_blocks.decode("ascii").split(","))


def prefix_pairs(prefix: str | None, blocks: tuple[str, ...]) -> list[tuple[bytes, bytes]]:
    pairs = []
    if prefix is not None:
        pairs.append((b"X-Meshnet-Prefix", prefix.encode("ascii")))
    if blocks:
        pairs.append((b"X-Meshnet-Prefix-Blocks", ",".join(blocks).encode("ascii")))
    return pairs


def valid_prefix_fields(prefix: object, blocks: object) -> bool:
    """For hand-built headers: a key or None; a tuple of keys."""

    def key(value: object) -> bool:
        return (
            isinstance(value, str)
            and value.isascii()
            and (BLOCK_KEY.fullmatch(value.encode("ascii")) is not None)
        )

    return (
        (prefix is None or key(prefix))
        and isinstance(blocks, tuple)
        and all(key(b) for b in blocks)
    )
