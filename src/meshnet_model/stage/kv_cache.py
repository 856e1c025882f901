"""Per-session key/value caches under one memory budget for all sessions.

A session's cache holds, for each of the stage's layers, the rotated keys and
the values of every position it has taken in: ``[batch, kv_heads, capacity,
head_dim]`` float32 (the compute dtype, so a decode step attends to exactly
the numbers a full recompute would make). Capacity grows geometrically (x2)
so a decode step is amortised O(1) copying; the budget counts allocated
capacity, not just the filled part, because that is the memory really held.
When doubling would break the budget the cache grows to exactly what the
chunk needs; when even that does not fit, ``KVBudgetExceeded`` — the node
answers 503 and nothing was allocated. A truncation (a failed chunk's
leftover, a speculative rewind: ``truncate``) keeps the capacity, and the
budget goes on counting it: the positions it frees are what the very next
chunk refills, and giving them back would copy the whole cache at every
verify window; the bytes go back when the session ends.

Thread-safety: chunks of one session never run concurrently (the node's
sequencer), but different sessions' chunks may, in worker threads, and a
session may be ended while its chunk computes. The budget's counter and a
cache's ``closed`` flag are guarded by one lock; a cache ended mid-compute
gives its bytes back at once and refuses to grow afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from ..errors import KVBudgetExceeded, SessionEnded

__all__ = ["KVBudget", "KVBudgetExceeded", "KVCache"]

KV_DTYPE = np.dtype(np.float32)
_MIN_CAPACITY = 16


class KVBudget:
    """Bytes of KV cache allocated across every session, against ``limit``."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("the KV budget must be positive")
        self.limit = limit
        self.lock = threading.Lock()
        self._in_use = 0
        self.peak = 0
        # Called with the lock held when a reservation does not fit: frees what
        # can go (the prefix cache's retained caches) before the chunk is refused.
        self.reclaim: Callable[[int], None] | None = None

    @property
    def in_use(self) -> int:
        return self._in_use

    def hold(self, nbytes: int) -> None:
        """Set ``nbytes`` aside for a cache about to arrive (a KV import's
        head, wire-2 §3.11), reclaiming retained caches first; or
        ``KVBudgetExceeded``. Given back with ``release``."""
        with self.lock:
            self._take_or_reclaim(nbytes, "a KV import needs")

    def _take_or_reclaim(self, nbytes: int, what: str) -> None:  # caller holds the lock
        """Take ``nbytes``, freeing retained caches first when they do not fit."""
        if self._take(nbytes):
            return
        if self.reclaim is not None:
            self.reclaim(nbytes)
            if self._take(nbytes):
                return
        raise KVBudgetExceeded(
            f"{what} {nbytes} more bytes; {self._in_use} of {self.limit} are in use",
            needed=nbytes,
            in_use=self._in_use,
            limit=self.limit,
        )

    def release(self, nbytes: int) -> None:
        with self.lock:
            self._give(nbytes)

    def _take(self, nbytes: int) -> bool:  # caller holds the lock
        if self._in_use + nbytes > self.limit:
            return False
        self._in_use += nbytes
        self.peak = max(self.peak, self._in_use)
        return True

    def _give(self, nbytes: int) -> None:  # caller holds the lock
        self._in_use -= nbytes
        assert self._in_use >= 0, "KV budget released more than it reserved"


class KVCache:
    """One session's keys and values for the layers of one stage."""

    def __init__(
        self, budget: KVBudget, *, layers: int, batch: int, kv_heads: int, head_dim: int
    ) -> None:
        self.budget = budget
        self.layers, self.batch, self.kv_heads, self.head_dim = layers, batch, kv_heads, head_dim
        self.length = 0  # positions filled (the same in every layer)
        self.capacity = 0
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self.closed = False

    # Bytes of one stored number; an engine keeping its cache in another dtype
    # (the torch engine: its compute dtype) says so, and the budget counts it.
    itemsize: int = KV_DTYPE.itemsize

    @property
    def bytes_per_position(self) -> int:
        return 2 * self.layers * self.batch * self.kv_heads * self.head_dim * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.capacity * self.bytes_per_position

    def truncate(self, length: int) -> None:
        """Forget positions from ``length`` on (what a failed or cancelled chunk
        left, or a rewind drops); the capacity, and its bytes, stay."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length

    def reserve(self, needed: int) -> None:
        """Make room for ``needed`` positions in all, within the budget."""
        if needed <= self.capacity:
            return
        per = self.bytes_per_position
        with self.budget.lock:
            if self.closed:
                raise SessionEnded("the session ended while its chunk was computing")
            grown = max(needed, 2 * self.capacity, _MIN_CAPACITY)
            for capacity in dict.fromkeys((grown, needed)):  # try doubling, then exact
                if self.budget._take((capacity - self.capacity) * per):
                    break
            else:
                capacity = needed
                self.budget._take_or_reclaim((needed - self.capacity) * per, "the KV cache needs")
            # Counted under the lock, so a close() racing with us gives back
            # exactly what was taken.
            self.capacity = capacity
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        """Hold ``capacity`` positions per layer, the filled ones copied over
        (budget already taken; an engine with its own arrays overrides this)."""
        shape = (self.batch, self.kv_heads, capacity, self.head_dim)
        filled = self.length
        keys, values = [], []
        for layer in range(self.layers):
            k = np.empty(shape, KV_DTYPE)
            v = np.empty(shape, KV_DTYPE)
            if filled:
                k[:, :, :filled] = self.keys[layer][:, :, :filled]
                v[:, :, :filled] = self.values[layer][:, :, :filled]
            keys.append(k)
            values.append(v)
        self.keys, self.values = keys, values

    def close(self) -> int:
        """Give the bytes back to the budget (idempotent); returns how many.

        The arrays themselves are dropped with the last reference to this
        cache: a chunk still computing on it finishes on memory it holds.
        """
        with self.budget.lock:
            return self.close_locked()

    def close_locked(self) -> int:
        """``close`` for a caller that holds the budget's lock."""
        if self.closed:
            return 0
        self.closed = True
        released = self.nbytes
        self.budget._give(released)
        return released

    @property
    def dtype_name(self) -> str:
        """The dtype of the numbers kept (a KV message's, wire-2 §3.11)."""
        return KV_DTYPE.name

    def export_state(self) -> np.ndarray:
        """A copy of the filled positions, ``[layers, 2, batch, kv_heads,
        length, head_dim]`` (keys, then values): a KV message's tensor."""
        n = self.length
        out = np.empty((self.layers, 2, self.batch, self.kv_heads, n, self.head_dim), KV_DTYPE)
        for layer in range(self.layers):
            out[layer, 0] = self.keys[layer][:, :, :n]
            out[layer, 1] = self.values[layer][:, :, :n]
        return out

    def import_state(self, state: np.ndarray) -> None:
        """Start this (empty) cache with ``state`` (``export_state``'s layout
        and dtype, from a replica of the same stage): bit for bit its numbers."""
        n = self._check_import(state)
        self.reserve(n)
        for layer in range(self.layers):
            self.keys[layer][:, :, :n] = state[layer, 0]
            self.values[layer][:, :, :n] = state[layer, 1]
        self.length = n

    def _check_import(self, state: np.ndarray) -> int:
        want = (self.layers, 2, self.batch, self.kv_heads, state.shape[4], self.head_dim)
        if self.length or state.shape != want or state.dtype.name != self.dtype_name:
            raise ValueError(
                f"import_state: an empty cache, and a state of {want} {self.dtype_name}; "
                f"got {state.shape} {state.dtype.name}"
            )
        return int(state.shape[4])

    def copy_prefix(self, source: KVCache, length: int) -> None:
        """Start this (empty) cache with ``source``'s first ``length`` positions
        (a prefix-cache hit: the numbers a cold run computed, bit for bit)."""
        if self.length or source.length < length or source.batch != self.batch:
            raise ValueError("copy_prefix: an empty cache, and a source holding the prefix")
        self.reserve(length)
        for layer in range(self.layers):
            self.keys[layer][:, :, :length] = source.keys[layer][:, :, :length]
            self.values[layer][:, :, :length] = source.values[layer][:, :, :length]
        self.length = length
