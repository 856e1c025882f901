"""The stage's prefix cache (wire-2 §3.10): KV filed under block keys.

A block key names a whole token prefix ``[0, end)`` (``end`` a multiple of
the block size). After a chunk of a session has run, the stage files the
session's cache under the keys of the blocks that ended in it; a new
session whose first chunk names one of those keys starts from a copy of
the first ``end`` positions instead of computing them. When a session ends,
its cache is *retained* (not freed) if it holds a filed prefix, and retained
caches are dropped least recently used first: past ``limit`` bytes, and
whenever a live session's cache needs room the budget does not have — a
retained prefix never refuses a live session (``KVBudget.reclaim``).

Memory accounting: a retained cache keeps exactly the bytes it held alive
(its allocated capacity, counted in the KV budget as before); a session
that attaches holds its own copy of the prefix, counted against the budget
like any cache. Nothing here is shared mutably: a filed cache is read only
by attaching sessions (its positions below a filed key's end never change
while it is filed — a truncation below one unfiles it first).

Thread-safety: every method takes the budget's lock (``find`` too), so the
store, the budget and a cache's ``closed`` flag change together.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .kv_cache import KVBudget, KVCache

__all__ = ["BlockNaming", "PrefixStore", "TokenChain"]


@dataclass(frozen=True, slots=True)
class BlockNaming:
    """How block keys name token prefixes: the block size and the hash chain
    (``keys(tokens, previous)``: the keys of the whole blocks of ``tokens``
    after the block whose key is ``previous``).

    The caller gives it (the node gives wire-2 §3.10's): this package
    computes and knows nothing of the wire, so the hash stays in one place.
    """

    block_tokens: int
    keys: Callable[[Sequence[int], str | None], list[str]]


class PrefixStore:
    """Block key → (cache, prefix length), with LRU retention of ended sessions' caches."""

    def __init__(self, budget: KVBudget, limit: int) -> None:
        self.budget = budget
        self.limit = limit  # bytes of retained caches at most (0: retain none)
        self._index: dict[str, tuple[KVCache, int]] = {}
        self._filed: dict[int, list[str]] = {}  # id(cache) -> the keys filed under it
        self._retained: OrderedDict[int, KVCache] = OrderedDict()
        self.retained_bytes = 0
        self.hits = 0
        self.misses = 0
        self.tokens_saved = 0
        budget.reclaim = self._reclaim_locked

    def file(self, cache: KVCache, keys: Sequence[tuple[str, int]]) -> None:
        """File ``cache`` under each ``(key, end)`` (its positions ``[0, end)`` are final)."""
        with self.budget.lock:
            if cache.closed:
                return
            filed = self._filed.setdefault(id(cache), [])
            for key, end in keys:
                if key not in self._index:  # the first holder keeps it: same numbers
                    self._index[key] = (cache, end)
                    filed.append(key)

    def unfile_after(self, cache: KVCache, position: int) -> None:
        """A truncation to ``position``: keys whose prefix reaches past it go."""
        with self.budget.lock:
            keys = self._filed.get(id(cache), [])
            keep = [k for k in keys if self._index[k][1] <= position]
            for key in keys:
                if self._index[key][1] > position:
                    del self._index[key]
            self._filed[id(cache)] = keep

    def find(self, key: str) -> tuple[KVCache, int] | None:
        """The cache holding ``key``'s prefix and its length; a hit refreshes
        a retained cache's place in the LRU order."""
        with self.budget.lock:
            found = self._index.get(key)
            if found is None or found[0].length < found[1]:
                self.misses += 1
                return None
            self.hits += 1
            if id(found[0]) in self._retained:
                self._retained.move_to_end(id(found[0]))
            return found

    def retain(self, cache: KVCache) -> bool:
        """At a session's end: keep its cache if it holds a filed prefix and
        fits under ``limit`` (evicting older ones); else unfile it. True if kept."""
        with self.budget.lock:
            keys = self._filed.get(id(cache))
            if not keys or cache.nbytes > self.limit or cache.closed:
                self._unfile_locked(cache)
                return False
            self._retained[id(cache)] = cache
            self.retained_bytes += cache.nbytes
            while self.retained_bytes > self.limit:
                self._evict_oldest_locked()
            return True

    def forget(self, cache: KVCache) -> None:
        """A cache that closes without being retained: unfile it."""
        with self.budget.lock:
            self._unfile_locked(cache)

    def clear(self) -> int:
        """Drop every retained cache; returns the bytes given back."""
        with self.budget.lock:
            freed = self.retained_bytes
            while self._retained:
                self._evict_oldest_locked()
            return freed

    @property
    def retained(self) -> int:
        return len(self._retained)

    # -- under the budget's lock ---------------------------------------------------------

    def _unfile_locked(self, cache: KVCache) -> None:
        for key in self._filed.pop(id(cache), []):
            if self._index.get(key, (None,))[0] is cache:
                del self._index[key]

    def _evict_oldest_locked(self) -> None:
        _, cache = self._retained.popitem(last=False)
        self.retained_bytes -= cache.nbytes
        self._unfile_locked(cache)
        cache.close_locked()

    def describe(self) -> dict[str, int]:
        """The runner's ``describe()["prefix_cache"]``."""
        return {
            "retained": self.retained,
            "retained_bytes": self.retained_bytes,
            "limit_bytes": self.limit,
            "hits": self.hits,
            "misses": self.misses,
            "tokens_saved": self.tokens_saved,
        }

    def _reclaim_locked(self, nbytes: int) -> None:
        """Free retained caches (oldest first) until ``nbytes`` more fit."""
        while self._retained and self.budget.in_use + nbytes > self.budget.limit:
            self._evict_oldest_locked()


class TokenChain:
    """The first stage's own count of a session's block keys, from the token
    ids it receives, to check the keys a sender files (wire-2 §3.10): a
    sender cannot file KV under a key that does not name its tokens."""

    def __init__(self, naming: BlockNaming, start: int = 0, key: str | None = None) -> None:
        self.naming = naming
        self.start = start  # a block boundary: 0, or the prefix the session attached
        # Every token since ``start``: a rewind may go back into any block
        # after it, whose key is then recomputed from its tokens. 4 bytes a
        # token, beside the KV cache's kilobytes a position.
        self.tokens: array[int] = array("i")
        self.keys: dict[int, str] = {start: key} if key is not None else {}

    def keys_for(self, position: int, chunk: np.ndarray) -> list[str]:
        """The keys of the blocks ending in ``chunk`` at ``position``; the
        chain then holds the chunk (anything past ``position`` is dropped:
        a retransmission after a failed chunk)."""
        self.rewind(position)
        ids = [int(t) for t in np.asarray(chunk).reshape(-1)]
        self.tokens.extend(ids)
        block = self.naming.block_tokens
        base = position // block * block
        tail = self.tokens[base - self.start :]
        keys = self.naming.keys(tail, self.keys.get(base) if base else None)
        for i, key in enumerate(keys):
            self.keys[base + (i + 1) * block] = key
        return keys

    def rewind(self, length: int) -> None:
        """Forget the tokens and block keys past ``length`` (a session's
        rewind): the blocks the next chunks complete are named from the
        tokens the session then holds."""
        if length < self.start:
            raise ValueError(f"position {length} is before the chain's start {self.start}")
        del self.tokens[length - self.start :]
        for end in [end for end in self.keys if end > length]:
            del self.keys[end]
