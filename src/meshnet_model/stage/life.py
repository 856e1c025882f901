"""A session's life on a stage: its cache, its prefix-cache bookkeeping and
its rewind (``StageRunner`` holds one per session and takes its lock around
what changes one).

Rewind (issue 38: speculative decoding): a verify window of drafted tokens
runs through every stage as one chunk; the positions past the accepted
prefix are then dropped from the session's cache before the next window.
``SessionLife.rewind(length, store)`` keeps exactly positions ``[0,
length)``:

* the cache is truncated (``KVCache.truncate``: its capacity, and so the
  budget's bytes, stay — the next window refills those positions at once);
* the prefix cache's view of it goes first: the block keys this cache is
  filed under whose prefix reaches past ``length`` are unfiled (a session
  attaching later finds them no more), and pending filings past it are
  dropped; the first stage's ``TokenChain`` forgets its keys and tokens
  past it, so the keys of the blocks the next chunks complete are checked
  against the tokens this session really holds;
* a session that attached a cached prefix may not rewind into it
  (``RewindRefused``, ``floor``): its cache holds a private copy of the
  prefix (``KVCache.copy_prefix``), so no other session's numbers could
  change, but the first stage never saw the prefix's tokens and could not
  name the blocks it would have to recompute. Speculation never needs it:
  a window starts after the prompt.

Nothing here writes a number into a cache, so no other session's cache or
any retained one is touched; a cache another session attached from stays
what that session copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import CacheMismatch, PrefixMismatch, RewindRefused, SessionBusy, SessionEnded
from .kv_cache import KVCache
from .prefix_store import BlockNaming, PrefixStore, TokenChain

__all__ = ["SessionLife", "StageWork"]


@dataclass(eq=False, slots=True)
class StageWork:
    """One chunk of one session for ``run_batch``; ``deadline`` on the
    ``time.monotonic()`` clock; ``logit_rows``: the last positions a last
    stage makes logits of (``BatchEntry``: a verify window's ``k + 1``).
    After the step exactly one of ``output`` and ``error`` is set."""

    life: SessionLife
    position: int
    inputs: np.ndarray
    deadline: float | None = None
    output: np.ndarray | None = None
    error: BaseException | None = None
    logit_rows: int = 1

    def result(self) -> np.ndarray:
        if self.error is not None:
            raise self.error
        assert self.output is not None
        return self.output


@dataclass(eq=False, slots=True)
class SessionLife:
    """One session's life on this stage: its cache, and whether it has ended.

    ``ended`` is set, and ``cache`` read, under the runner's lock; a life
    that has ended never gets a cache again.
    """

    session: str
    cache: KVCache | None = None
    ended: bool = False
    # The prefix cache (wire-2 §3.10): the prefix a new session starts from,
    # the block keys of the chunk in hand with their ends (filed once it has
    # run), and the first stage's own count of the keys.
    attach: str | None = None
    pending: list[tuple[str, int]] = field(default_factory=list)
    chain: TokenChain | None = None
    # Its cache came in a KV import (wire-2 §3.11): it files no prefix blocks
    # (a first stage never saw its tokens, so it could not check their keys).
    imported: bool = False
    # The positions of the prefix it attached: a rewind stops there.
    floor: int = 0
    # The work of the step computing it (set and cleared under the runner's
    # lock): a rewind then would race the layers writing the cache.
    busy: StageWork | None = None

    def prepare_prefix(
        self,
        position: int,
        inputs: np.ndarray,
        prefix: str | None,
        blocks: Sequence[str],
        naming: BlockNaming,
        *,
        first: bool,
    ) -> None:
        """``StageRunner.prepare_prefix``: note the prefix a new session starts
        from and the keys to file once the chunk has run; the ``first`` stage
        checks the keys against the token ids (``PrefixMismatch``)."""
        if self.imported:
            self.pending = []
            return
        if prefix is not None and self.cache is None:
            self.attach = prefix
        block = naming.block_tokens
        start = position // block
        self.pending = [(key, (start + i + 1) * block) for i, key in enumerate(blocks)]
        if not (first and inputs.ndim == 2 and inputs.shape[0] == 1):
            return  # only token ids can be checked; the stages below trust their sender
        if self.chain is None:
            if position and prefix is None:
                if not blocks:
                    return  # a session that never files: nothing to check
                raise PrefixMismatch("block keys must be sent from the session's first chunk")
            self.chain = TokenChain(naming, position if prefix else 0, prefix)
        keys = self.chain.keys_for(position, inputs)
        if blocks and list(blocks) != keys:
            raise PrefixMismatch(
                "x-meshnet-prefix-blocks does not name this session's tokens "
                f"(the first stage computes {len(keys)} other keys)"
            )

    def file_ready(self, store: PrefixStore) -> None:
        """File the cache under the keys of the blocks it now holds."""
        cache = self.cache
        if not self.pending or cache is None:
            return
        ready = [(key, end) for key, end in self.pending if end <= cache.length]
        if ready:
            store.file(cache, ready)
            self.pending = [item for item in self.pending if item[1] > cache.length]

    def rewind_chunk(self, length: int, store: PrefixStore) -> int:
        """A rewind chunk's (wire-2 §3.16) ``rewind`` of the life it was
        admitted with, under the runner's lock: ``SessionEnded`` if it ended,
        ``SessionBusy`` while a step computes it, ``CacheMismatch`` when its
        cache holds fewer than ``length`` positions (context this stage never
        saw). Any positions past ``length`` go, whatever their number: a
        rewind whose compute stopped (a spent deadline) left the cache at
        ``length`` already, and its retransmission must still run."""
        if self.ended:
            raise SessionEnded(f"session {self.session} ended before its rewind")
        if self.busy is not None:
            raise SessionBusy(f"session {self.session}: a chunk of it is computing")
        held = 0 if self.cache is None else self.cache.length
        if held < length:
            raise CacheMismatch(
                f"session {self.session}: this stage's KV cache holds {held} positions, "
                f"the rewind keeps {length}"
            )
        return self.rewind(length, store)

    def rewind(self, length: int, store: PrefixStore) -> int:
        """Keep positions ``[0, length)`` (see the module's docstring); returns
        how many went. The caller holds the runner's lock and has checked
        that no step computes this session."""
        held = 0 if self.cache is None else self.cache.length
        if not 0 <= length <= held:
            raise RewindRefused(
                f"session {self.session}: cannot rewind to {length}, this stage holds "
                f"{held} positions",
                length=length,
                held=held,
                floor=self.floor,
            )
        if length < self.floor:
            raise RewindRefused(
                f"session {self.session}: cannot rewind to {length}, into the cached prefix "
                f"of {self.floor} positions it started from",
                length=length,
                held=held,
                floor=self.floor,
            )
        if self.cache is None or length == held:
            return 0
        # Unfiled before the positions go: a session attaching from now on
        # never finds a key whose prefix this cache no longer holds.
        store.unfile_after(self.cache, length)
        self.cache.truncate(length)
        self.pending = [item for item in self.pending if item[1] <= length]
        if self.chain is not None:
            self.chain.rewind(length)
        return held - length
