"""Several sessions' chunks in one forward pass: the rows, packed.

A batched step runs the chunks of different sessions through the stage's
layers together. Every matrix product takes all their rows at once — the
weights are read once per step, not once per session, which is what makes
decoding many streams cost little more than one — while attention stays per
session, each chunk's queries over its own cache at its own positions. The
rows are *packed*: chunk after chunk along one axis, ``[rows, hidden]``, so
chunks of different lengths at different positions batch without padding.

``BatchEntry`` is one chunk; ``PackedBatch`` is the bookkeeping an engine
needs around its arrays: which entries are still running, where each one's
rows are, and the per-entry stop checks between layers. An entry that stops
(its session ended, its deadline passed) or fails before the compute (its KV
budget) gets its error and leaves the batch; the others go on, and none of
them sees the difference.

Bit for bit, whatever the step: a replica that recomputes a session (failover
by replay) must produce the very bits the first computation sent, or the next
hop sees a conflicting retransmission. So a chunk's numbers must not depend
on the step it ran in, nor on how the scheduler cut it:

* a matrix product is shared by all the entries only where its kernel is
  row-invariant — each row's result depends on that row alone: torch's
  int4pack kernel is (a stage holding only such matrices is
  ``row_invariant``). BLAS and oneDNN are not across row counts (their
  small-matrix and blocked kernels are picked by the number of rows and sum
  in another order: measured), but they are within one shape: a product of
  exactly ``SHARED_ROWS`` rows gives each row the same bits whatever the
  other rows hold and wherever it sits among them (measured on numpy's
  OpenBLAS and torch's oneDNN, float32 and bfloat16, one and two threads;
  ``tests/model/test_shared_rows.py`` checks it on the machine it runs on).
  So a dense product shares fixed tiles of ``SHARED_ROWS`` rows, zero-padded,
  among the entries of at most that many rows (decode steps, verify
  windows: what many streams are made of), and runs each larger entry alone
  on exactly its own rows (``product_segments``). A chunk is replayed as it
  was sent (runtime.history), so it takes the same path again;
* attention runs in query blocks aligned to absolute positions
  (``query_blocks``): the queries ``[a, b)`` attend to keys ``[0, b)``
  whatever chunk or piece they arrived in, so in a row-invariant stage a
  chunk computed whole and in pieces cut at block boundaries give the same
  numbers — the only stages whose chunks the scheduler cuts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from ..errors import StageInputError, StageInvariantError
from .kv_cache import KVCache

__all__ = [
    "ATTENTION_BLOCK",
    "SHARED_ROWS",
    "BatchEntry",
    "PackedBatch",
    "product_segments",
    "query_blocks",
]

# Query rows attended at once, in blocks aligned to multiples of this
# position; a step splits a chunk only at these boundaries.
ATTENTION_BLOCK = 8

# The rows of one shared dense product (a tile): entries of at most this many
# rows share tiles of exactly this many, zero-padded. One decode row padded to
# 8 costs about what it costs alone (the weights' read dominates), and 16
# streams take 2 products instead of 16.
SHARED_ROWS = 8


def product_segments(
    entry_rows: Sequence[tuple[int, int]], tile: int = SHARED_ROWS
) -> list[tuple[int, int, bool]]:
    """A dense product's calls over packed rows, as ``(lo, hi, padded)``: runs
    of consecutive entries of at most ``tile`` rows cut into tiles of
    ``tile`` rows (the last one padded to ``tile``: ``padded`` true), and
    each larger entry alone (``padded`` false). The calls cover the rows in
    order, so their outputs concatenate into the product's."""
    segments: list[tuple[int, int, bool]] = []
    run: tuple[int, int] | None = None  # the pending run of small entries' rows
    for lo, hi in entry_rows:
        if hi - lo > tile:
            segments.extend(_tiles(run, tile))
            run = None
            segments.append((lo, hi, False))
        else:
            run = (lo, hi) if run is None else (run[0], hi)
    segments.extend(_tiles(run, tile))
    return segments


def _tiles(run: tuple[int, int] | None, tile: int) -> list[tuple[int, int, bool]]:
    if run is None:
        return []
    start, end = run
    return [(lo, min(lo + tile, end), True) for lo in range(start, end, tile)]


def query_blocks(past: int, tokens: int, size: int = ATTENTION_BLOCK) -> list[tuple[int, int]]:
    """The chunk's query blocks as ``[lo, hi)`` offsets into it: cut at every
    absolute position that is a multiple of ``size``."""
    blocks = []
    start, end = past, past + tokens
    while start < end:
        stop = min(end, (start // size + 1) * size)
        blocks.append((start - past, stop - past))
        start = stop
    return blocks


CacheT = TypeVar("CacheT", bound=KVCache)


@dataclass(eq=False, slots=True)
class BatchEntry(Generic[CacheT]):
    """One session's chunk in a step: ``inputs`` (``[batch, tokens]`` ids or
    ``[batch, tokens, hidden]``) at ``position`` of ``cache``; ``stop`` is
    called before each layer and raises to stop this entry alone. After the
    step exactly one of ``output`` and ``error`` is set.

    ``logit_rows``: how many of each batch row's last positions a last
    stage's head makes logits of — 1 (``[batch, vocab]``), or a verify
    window's ``k + 1`` (``[batch, k + 1, vocab]``: wire-2 §3.16)."""

    inputs: np.ndarray
    cache: CacheT
    position: int
    stop: Callable[[], None] | None = None
    output: np.ndarray | None = None
    error: BaseException | None = None
    logit_rows: int = 1

    @property
    def batch(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def tokens(self) -> int:
        return int(self.inputs.shape[1])

    @property
    def rows(self) -> int:
        return self.batch * self.tokens

    @property
    def query_block(self) -> int:
        """The query rows its attention takes at once: a verify window's rows
        one by one, each over exactly the keys its decode step would see, so
        on a row-invariant stage the window's rows are the bits of the
        one-token steps they stand for (greedy identity: wire-2 §3.16); any
        other chunk's in aligned blocks (``query_blocks``)."""
        return 1 if self.logit_rows > 1 else ATTENTION_BLOCK

    def head_output(self, logits: np.ndarray) -> np.ndarray:
        """The head's ``[batch * logit_rows, vocab]`` rows of this entry (on
        the host) as its output: ``[batch, vocab]``, or ``[batch,
        logit_rows, vocab]``."""
        if self.logit_rows == 1:
            return logits
        return logits.reshape(self.batch, self.logit_rows, -1)


class PackedBatch(Generic[CacheT]):
    """The running entries of a step and where their rows lie in the packing."""

    def __init__(self, entries: Sequence[BatchEntry[CacheT]]) -> None:
        self.entries = list(entries)
        self.running: list[BatchEntry[CacheT]] = []
        for entry in self.entries:
            if not 1 <= entry.logit_rows <= entry.tokens:
                entry.error = StageInputError(
                    f"{entry.logit_rows} logit rows asked of a chunk of {entry.tokens} tokens"
                )
                continue
            if entry.cache.length != entry.position:
                entry.error = StageInvariantError(
                    f"the KV cache holds {entry.cache.length} positions, the chunk starts at "
                    f"{entry.position}"
                )
                continue
            try:
                # The KV growth is checked against its budget before any
                # compute: a refused entry allocates nothing, and leaves.
                entry.cache.reserve(entry.position + entry.tokens)
            except Exception as exc:  # KVBudgetExceeded, SessionEnded
                entry.error = exc
                continue
            self.running.append(entry)

    @property
    def rows(self) -> int:
        return sum(entry.rows for entry in self.running)

    def spans(self) -> Iterator[tuple[BatchEntry[CacheT], int, int]]:
        """Each running entry with its rows' ``[lo, hi)`` in the packing."""
        lo = 0
        for entry in self.running:
            yield entry, lo, lo + entry.rows
            lo += entry.rows

    def entry_rows(self) -> list[tuple[int, int]]:
        """Each running entry's rows ``[lo, hi)``: where a product that is not
        row-invariant is cut, so each entry's part of it is the product it
        has alone, whatever else the step holds."""
        return [(lo, hi) for _, lo, hi in self.spans()]

    def last_rows(self) -> list[int]:
        """Where each running entry's last ``logit_rows`` positions lie, for
        each of its batch rows: the rows a last stage's head takes, in
        ``head_rows`` order."""
        return [
            row
            for entry, lo, hi in self.spans()
            for end in range(lo + entry.tokens, hi + 1, entry.tokens)
            for row in range(end - entry.logit_rows, end)
        ]

    def head_rows(self) -> list[tuple[int, int]]:
        """``entry_rows`` of the ``last_rows`` alone (``logit_rows`` per batch
        row of each entry): the head's product and output, per entry."""
        rows, lo = [], 0
        for entry in self.running:
            rows.append((lo, lo + entry.batch * entry.logit_rows))
            lo += entry.batch * entry.logit_rows
        return rows

    def check_stops(self) -> list[tuple[int, int]] | None:
        """Ask every running entry whether it must stop; None when all go on,
        else the row spans (of the packing as it was) of those that do — the
        engine keeps just those rows."""
        kept: list[tuple[int, int]] = []
        stopped = False
        survivors = []
        for entry, lo, hi in self.spans():
            try:
                if entry.stop is not None:
                    entry.stop()
            except Exception as exc:  # SessionEnded, ComputeDeadlineExceeded
                entry.error = exc
                stopped = True
                continue
            survivors.append(entry)
            kept.append((lo, hi))
        if not stopped:
            return None
        self.running = survivors
        return kept

    def finish(self, outputs: Sequence[np.ndarray]) -> None:
        """Hand each running entry its output; their caches now hold the chunk."""
        if len(outputs) != len(self.running):
            raise StageInvariantError(
                f"the step computed {len(outputs)} outputs for {len(self.running)} chunks"
            )
        for entry, output in zip(self.running, outputs, strict=True):
            entry.cache.length = entry.position + entry.tokens
            entry.output = output

    def result(self, index: int = 0) -> np.ndarray:
        """Entry ``index``'s output, or its error raised (a batch of one: ``forward``)."""
        entry = self.entries[index]
        if entry.error is not None:
            raise entry.error
        assert entry.output is not None
        return entry.output
