"""What a KV move may make a node hold (wire-2 §3.11), bounded before it is held.

A move is one request: an import (from its head, which sets the KV's bytes
aside, until its body has been taken or refused) or an export (from the
copy of the session's KV until its answer is written or the client is
gone). ``KVTransfers`` counts the moves open at once, per peer and in all,
and refuses one more with 503 ``kv_transfers_full`` before any byte is
held: a peer that opens import heads and never sends the bodies, or asks
for exports and never reads them, holds at most its share, for at most
the import's body deadline or the write timeout. ``check_finite`` refuses
a KV holding NaN or infinity before it becomes a session's cache.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from meshnet_proto import CapacityError, ErrorCode, ProtocolError

__all__ = ["KV_TRANSFER_RETRY_AFTER", "KVTransfers", "Transfer", "check_finite"]

# Seconds a refused mover is told to wait: a move ends within its body's
# deadline or its write, typically well under that.
KV_TRANSFER_RETRY_AFTER = 2

# Elements whose finiteness is checked at once: the check's scratch (one bool
# each) stays at 4 MiB however large the KV.
_FINITE_SLICE = 4 * 1024 * 1024


class Transfer:
    """One open move's place; calling it gives the place back (idempotent),
    as a request's cleanup does however the request ended."""

    __slots__ = ("_owner", "peer")

    def __init__(self, owner: KVTransfers, peer: str | None) -> None:
        self._owner: KVTransfers | None = owner
        self.peer = peer

    def __call__(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._give_back(self.peer)


class KVTransfers:
    """At most ``per_peer`` moves of one peer (its address) and ``total`` in
    all, imports and exports together."""

    def __init__(self, total: int, per_peer: int, *, retry_after: int = KV_TRANSFER_RETRY_AFTER):
        if total < 1 or per_peer < 1:
            raise ValueError("KV transfer bounds must be at least 1")
        self.total = total
        self.per_peer = per_peer
        self.retry_after = retry_after
        self._by_peer: Counter[str | None] = Counter()
        self.open = 0

    def take(self, peer: str | None, what: str) -> Transfer:
        """A place for one move of ``peer``, or 503 ``kv_transfers_full``."""
        held = self._by_peer[peer]
        if held >= self.per_peer or self.open >= self.total:
            whose = (
                f"this peer holds {held} of its {self.per_peer}"
                if held >= self.per_peer
                else f"{self.open} of this node's {self.total} are open"
            )
            raise CapacityError(
                f"{what}: too many KV moves at once ({whose}; --max-kv-transfers-per-peer, "
                "--max-kv-transfers): retry shortly",
                code=ErrorCode.KV_TRANSFERS_FULL,
                retry_after=self.retry_after,
            )
        self._by_peer[peer] = held + 1
        self.open += 1
        return Transfer(self, peer)

    def _give_back(self, peer: str | None) -> None:
        self.open -= 1
        left = self._by_peer[peer] - 1
        if left:
            self._by_peer[peer] = left
        else:
            del self._by_peer[peer]  # a peer that moved once holds no entry after

    def describe(self) -> dict[str, int]:
        return {"open": self.open, "max": self.total, "max_per_peer": self.per_peer}


def check_finite(tensor: np.ndarray) -> None:
    """400 ``bad_kv`` when a float KV holds NaN or infinity: attention over it
    answers NaN for every later token of the session (wire-2 §3.11)."""
    if tensor.dtype.kind not in "fV":  # float16/32; "V": ml_dtypes' bfloat16
        return  # not a float KV: the dtype check refused it already
    flat = tensor.reshape(-1)
    for start in range(0, flat.size, _FINITE_SLICE):
        if not np.isfinite(flat[start : start + _FINITE_SLICE]).all():
            raise ProtocolError(
                "the KV holds NaN or infinity: nothing was imported",
                code=ErrorCode.BAD_KV,
            )
