"""The stage scheduler: every step, the ready chunks of different sessions run
as one forward pass (continuous batching).

A node is handed chunks one request at a time, each on its own task; the
scheduler queues them and runs *steps*. A step takes queued work under a row
budget and runs it through ``StageRunner.run_batch`` in a worker thread: one
hand-off, one pass of per-layer overhead for all of it, and on a stage whose
products are row-invariant (int4pack) each weight read once for the step
(``stage.batch``; what that buys on a CPU: docs/models.md).

Which work a step takes (``plan_step``, pure):

1. Decode steps (chunks of one token, and verify windows: wire-2 §3.16)
   first, oldest first, up to the micro-batch cap (below) and the row budget
   (``--max-batch-tokens``). A window is a stream's step too, and is never
   cut: the last stage's head needs all its ``k + 1`` rows in one piece.
2. Prefill: the chunks of prompts, oldest first, in pieces. A chunk may be
   split across steps (chunked prefill, on stages whose products are
   row-invariant: the int4pack quantized ones): its rows then compute a
   piece per step, and it is answered when its last piece is done. Pieces
   end on the engines' aligned query blocks (``stage.batch``): the chunk's
   numbers are the same bits whole or in pieces, whatever the load, so a
   replica that recomputes it (failover by replay) sends exactly what the
   first one did. Beside decode steps — queued, or decoding at another stage
   — prefill gets at most as many rows as they have (at least
   ``MIN_PREFILL_ROWS``), so a long prompt arriving at most doubles the
   running streams' step; alone, prefill gets the whole budget. A chunk
   that cannot be split (a float stage's) is taken whole: alone, or beside
   decode steps once the steps that passed it over have credited it the
   rows it would have had in pieces (``credit_passed_over``) — so it waits
   a bounded number of steps, then stalls the streams for one step, the
   price of a stage that cannot split it.
3. At least one piece of work per step, so nothing starves.

Micro-batches: with S stages in a chain, a stage that takes every ready
session at once leaves the other S-1 idle while it computes, and then idles
itself. A step takes at most ``ceil(active / S)`` decode steps, ``active``
being the sessions that decoded in the last few steps, so S groups of
sessions are in flight and every stage computes one while the others compute
the rest (``--micro-batches``, ``auto``: the chain's stage count as this
node's layer share implies it).

Leadership, not a background task: the task of some queued work runs each
step; the others wait for the step's end and find their work done, or one of
them runs the next step. So the scheduler needs no task group of its own,
and a cancelled request leaves the queue at once (or, if its work is in the
step being computed, when the step ends: the thread cannot be interrupted).

Admission: the queue is bounded (``--max-queued-tokens`` rows); work beyond
it is refused at once, before any compute, 503 ``stage_busy`` with a
``Retry-After`` from the queue's size and the measured rate.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import anyio
import numpy as np

from meshnet_model.engines.core_ledger import CoreLedger, ledger_step
from meshnet_model.errors import SessionBusy
from meshnet_model.stage.batch import ATTENTION_BLOCK
from meshnet_model.stage.runner import SessionLife, StageRunner, StageWork
from meshnet_proto import CapacityError, ErrorCode

__all__ = [
    "DEFAULT_MAX_BATCH_TOKENS",
    "DEFAULT_MAX_QUEUED_TOKENS",
    "MIN_PREFILL_ROWS",
    "StageScheduler",
    "Work",
    "credit_passed_over",
    "micro_batches_for",
    "plan_step",
    "prefill_share",
]

# Rows of one step: a few chunks of prefill, or that many decode steps.
DEFAULT_MAX_BATCH_TOKENS = 256
# Rows waiting for compute before new work is refused (503 stage_busy).
DEFAULT_MAX_QUEUED_TOKENS = 32768
# Prefill rows a step always may take beside its decode steps.
MIN_PREFILL_ROWS = ATTENTION_BLOCK  # one aligned query block
# Steps a session counts as decoding after its last decode step.
_ACTIVE_STEPS = 4
# A step waits for the rest of its micro-batch at most this share of a step's
# time, and never longer than this many seconds.
_GATHER_SHARE = 0.25
_MAX_GATHER = 0.01


@dataclass(eq=False, slots=True)
class Work:
    """One chunk of one session, queued; computed in one or more pieces."""

    life: SessionLife
    start: int  # the chunk's position in the session
    tensor: np.ndarray
    deadline: float | None = None
    done: int = 0  # tokens computed so far
    parts: list[np.ndarray] = field(default_factory=list)
    error: BaseException | None = None
    finished: bool = False
    queued: bool = True  # in the scheduler's queue, its rows counted there
    # A chunk that cannot be split: the prefill rows the steps that passed it
    # over would have given it (credit_passed_over); taken whole once they
    # add up to it, so it waits a bounded number of steps beside decoders.
    credit: int = 0
    # The last positions a last stage makes logits of: a verify window's k + 1.
    logit_rows: int = 1

    @property
    def batch(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def tokens(self) -> int:
        return int(self.tensor.shape[1])

    @property
    def remaining(self) -> int:
        return self.tokens - self.done

    @property
    def decode(self) -> bool:
        """A stream's step, taken whole and first: one token, or a window."""
        return self.tokens == 1 or self.logit_rows > 1

    def result(self) -> np.ndarray:
        if self.error is not None:
            raise self.error
        if len(self.parts) == 1 or self.parts[-1].ndim == 2:
            return self.parts[-1]  # whole, or a last stage's logits: its last piece's
        return np.concatenate(self.parts, axis=1)


def plan_step(
    queue: Sequence[Work],
    *,
    budget: int,
    decode_cap: int | None = None,
    decoding: int = 0,
    align: int = ATTENTION_BLOCK,
    split: bool = True,
    tile: int | None = None,
) -> list[tuple[Work, int]]:
    """The step's work and how many tokens of each (see the module docstring).
    A piece of a chunk ends at a multiple of ``align`` (or at the chunk's end):
    the engines' query blocks, so its numbers are the chunk's whole. With
    ``split`` False (a stage whose products are not row-invariant) a chunk is
    taken whole or not at all, past the share only when it is the step's
    first piece of work. ``decoding``: the decode steps a step of this node
    usually has (its micro-batch), queued now or not. ``tile``: no piece
    ends strictly inside an aligned block of ``tile`` positions that lies
    wholly in its chunk (an engine's fixed-shape tiles, ``_off_tiles``)."""
    taken: list[tuple[Work, int]] = []
    rows = 0
    for work in queue:
        if not work.decode:
            continue
        if decode_cap is not None and len(taken) >= decode_cap:
            break
        if rows + work.batch * work.tokens > budget and taken:
            break
        taken.append((work, work.tokens))
        rows += work.batch * work.tokens
    # Alone, prefill has the budget; beside decode steps, as many rows as they
    # have (never fewer than MIN_PREFILL_ROWS: a prompt always progresses).
    # Sessions decoding but not queued this instant (their group is at another
    # stage) count too: a step must not take a whole chunk just before they land.
    share = prefill_share(budget, rows, decoding)
    for work in queue:
        if work.decode:
            continue
        tokens = min(work.remaining, share // work.batch) if share > 0 else 0
        if not split and tokens < work.remaining:
            owed = work.credit + share >= work.remaining * work.batch
            tokens = work.remaining if not taken or owed else 0
        if tokens == 0 and taken:
            break
        taken.append((work, _aligned(work, tokens, align, tile)))
        share -= taken[-1][1] * work.batch
    return taken


def prefill_share(budget: int, decode_rows: int, decoding: int = 0) -> int:
    """The prefill rows a step may take beside ``decode_rows`` of decode steps."""
    beside = max(decode_rows, decoding)
    if not beside:
        return budget - decode_rows
    return max(MIN_PREFILL_ROWS, min(budget - decode_rows, beside))


def credit_passed_over(
    queue: Sequence[Work], plan: Sequence[tuple[Work, int]], *, budget: int, decoding: int = 0
) -> None:
    """After planning a step that left the oldest prompt chunk waiting (one
    that cannot be split, beside decode steps): credit it the prefill share
    it would have had in pieces. Without this a prompt on such a stage runs
    only in the gaps between decoders' steps, which steady streams close: its
    wait was unbounded. With it, it waits at most
    ``ceil(rows / MIN_PREFILL_ROWS)`` steps, and then stalls one step."""
    if any(not work.decode for work, _ in plan):
        return  # a prompt ran this step: nothing was passed over
    waiting = next((work for work in queue if not work.decode), None)
    if waiting is None:
        return
    decode_rows = sum(work.batch for work, _ in plan)
    waiting.credit += prefill_share(budget, decode_rows, decoding)


def _aligned(work: Work, tokens: int, align: int, tile: int | None = None) -> int:
    """``tokens`` cut back to end on an aligned position — at least to the
    next one (or the chunk's end), so the piece is never empty."""
    if tokens >= work.remaining:
        return work.remaining
    here = work.start + work.done
    end = (here + tokens) // align * align
    if end <= here:
        end = (here // align + 1) * align
    if tile is not None:
        end = _off_tiles(work, here, end, tile)
    return min(end - here, work.remaining)


def _off_tiles(work: Work, here: int, end: int, tile: int) -> int:
    """A piece's ``end`` moved out of a whole tile of its chunk: back to the
    tile's start, or on to its end when the piece starts there."""
    start = end // tile * tile
    if start == end or start < work.start or start + tile > work.start + work.tokens:
        return end
    return start if start > here else start + tile


def _smoothed(previous: float, value: float) -> float:
    """An exponential moving average (the first value taken as is)."""
    return value if not previous else 0.8 * previous + 0.2 * value


def micro_batches_for(layers: range, total_layers: int) -> int:
    """The stage count of a chain with this node's share of the layers."""
    return max(1, round(total_layers / max(len(layers), 1)))


class StageScheduler:
    """Queues a node's chunks and runs them in batched steps (module docstring)."""

    def __init__(
        self,
        runner: StageRunner,
        *,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS,
        micro_batches: int = 1,
        on_step: Callable[[int, int, float], None] | None = None,
    ) -> None:
        self.runner = runner
        self.max_batch_tokens = max_batch_tokens
        self.max_queued_tokens = max_queued_tokens
        self.micro_batches = micro_batches
        # Chunks are cut into pieces only where that changes no bit (stage.batch).
        self.split = runner.model.row_invariant
        # ...and never inside a whole tile of an engine's fixed-shape products
        # (a quantized torch stage's dense tiles: dense_tiles.TILE_ROWS), or None.
        self.tile = runner.model.piece_tile
        self.on_step = on_step  # (chunks, rows, seconds) of each step: metrics
        self.cores: CoreLedger | None = None  # --share-cores-with: each step's threads
        self.queue: deque[Work] = deque()
        self.queued_rows = 0
        self.steps = 0
        self.busy_seconds = 0.0
        self._rows_per_second = 0.0  # measured, for Retry-After
        self._recent: dict[str, int] = {}  # session -> step of its last decode
        self._leading = False
        self._step_over = anyio.Event()
        self._arrived = anyio.Event()  # set (and replaced) whenever work is queued
        self._step_seconds = 0.0  # a step's time, smoothed: the gather window

    async def run(
        self,
        life: SessionLife,
        position: int,
        tensor: np.ndarray,
        deadline: float | None,
        logit_rows: int = 1,
    ) -> np.ndarray:
        """Queue one chunk and return its output when its last piece has run."""
        work = Work(life, position, tensor, deadline, logit_rows=logit_rows)
        self._admit(work)
        try:
            while not work.finished:
                if self._leading:
                    await self._step_over.wait()
                    continue
                await self._lead()
        except BaseException:
            if not work.finished:
                self._drop(work)
            raise
        return work.result()

    async def rewind(self, life: SessionLife, length: int) -> int:
        """Keep ``life``'s first ``length`` positions (a rewind chunk, wire-2
        §3.16) before its chunk is queued, between steps: never while a step
        computes the session (only a step still finishing a cancelled chunk
        of it can: the rewind waits for that step's end). How many went."""
        while True:
            try:
                return self.runner.rewind(life.session, length, life)
            except SessionBusy:
                if not self._leading:  # busy is set only within a step
                    raise
                await self._step_over.wait()

    def _admit(self, work: Work) -> None:
        rows = work.batch * work.tokens
        if self.queue and self.queued_rows + rows > self.max_queued_tokens:
            rate = self._rows_per_second or 1.0
            raise CapacityError(
                f"{self.queued_rows} rows already wait for this stage's compute "
                f"(--max-queued-tokens {self.max_queued_tokens})",
                code=ErrorCode.STAGE_BUSY,
                retry_after=max(1, math.ceil(self.queued_rows / rate)),
            )
        self.queue.append(work)
        self.queued_rows += rows
        arrived, self._arrived = self._arrived, anyio.Event()
        arrived.set()

    def _drop(self, work: Work) -> None:
        """Out of the queue: finished, failed, or its request gone (cancelled)."""
        if not work.queued:
            return
        work.queued = False
        self.queue.remove(work)
        self.queued_rows -= work.batch * work.remaining

    async def _lead(self) -> None:
        """Run one step (this task leads it), then wake everyone waiting."""
        self._leading = True
        try:
            active = self._active()
            cap = self._decode_cap(active)
            expected = min(cap or active, active)
            if expected > 1 and self._step_seconds:
                await self._gather(expected)
            plan = plan_step(
                self.queue,
                budget=self.max_batch_tokens,
                decode_cap=cap,
                decoding=expected,
                split=self.split,
                tile=self.tile,
            )
            if not self.split:
                credit_passed_over(
                    self.queue, plan, budget=self.max_batch_tokens, decoding=expected
                )
            started = time.perf_counter()
            # A worker thread cannot be interrupted: the step is seen through to
            # its accounting even if this task's request is cancelled meanwhile.
            with anyio.CancelScope(shield=True):
                pieces = await anyio.to_thread.run_sync(self._compute, plan)
                self._account(plan, pieces, time.perf_counter() - started)
        finally:
            self._leading = False
            over, self._step_over = self._step_over, anyio.Event()
            over.set()

    def _decode_cap(self, active: int) -> int | None:
        """At most ``ceil(active / micro_batches)`` decode steps (None: no cap)."""
        if self.micro_batches <= 1:
            return None
        return math.ceil(max(active, 1) / self.micro_batches)

    def _active(self) -> int:
        """Sessions that decoded in the last few rounds of micro-batches."""
        floor = self.steps - _ACTIVE_STEPS * max(self.micro_batches, 1)
        for session in [s for s, step in self._recent.items() if step < floor]:
            del self._recent[session]
        return len(self._recent)

    async def _gather(self, expected: int) -> None:
        """Wait a moment for the rest of a micro-batch (its chunks come one
        request at a time from the stage above): until ``expected`` decode
        steps are queued, or a quarter of a step's time has passed."""
        window = min(_MAX_GATHER, _GATHER_SHARE * self._step_seconds)
        with anyio.move_on_after(window):
            while sum(1 for w in self.queue if w.decode) < expected:
                await self._arrived.wait()

    def _compute(self, plan: list[tuple[Work, int]]) -> list[StageWork]:
        """The step, in the worker thread: each piece its own ``StageWork``.
        Touches no ``Work`` (the event loop may drop one meanwhile)."""
        pieces = []
        for work, tokens in plan:
            rows = work.tensor[:, work.done : work.done + tokens]
            piece = StageWork(
                work.life, work.start + work.done, rows, work.deadline, logit_rows=work.logit_rows
            )
            pieces.append(piece)
            if work.done == 0 and tokens < work.tokens:
                try:  # a chunk in pieces: its values are checked whole, before the first
                    self.runner.check_input(work.tensor, work.start)
                except Exception as exc:  # whatever the check raises is this chunk's answer
                    piece.error = exc
        try:
            with ledger_step(self.cores):  # the step's cores, where stages share them
                self.runner.run_batch([piece for piece in pieces if piece.error is None])
        except Exception as exc:  # the step itself failed (an engine invariant): all of it
            for piece in pieces:
                piece.error = piece.error or exc
        return pieces

    def _account(
        self, plan: list[tuple[Work, int]], pieces: list[StageWork], elapsed: float
    ) -> None:
        """After a step, in the event loop: each work takes its piece's outcome;
        what is done or failed leaves the queue."""
        self.steps += 1
        self.busy_seconds += elapsed
        rows = sum(work.batch * tokens for work, tokens in plan)
        self._step_seconds = _smoothed(self._step_seconds, elapsed)
        if elapsed > 0:
            self._rows_per_second = _smoothed(self._rows_per_second, rows / elapsed)
        for (work, tokens), piece in zip(plan, pieces, strict=True):
            if not work.queued:  # its request went away while the step computed
                continue
            if work.decode:
                self._recent[work.life.session] = self.steps
            if piece.error is not None:
                work.error = piece.error
            else:
                assert piece.output is not None
                work.parts.append(piece.output)
                work.done += tokens
                self.queued_rows -= work.batch * tokens  # computed: no longer waiting
            if work.error is not None or work.remaining == 0:
                self._drop(work)  # what it had left no longer waits either
                work.finished = True
        if self.on_step is not None:
            self.on_step(len(plan), rows, elapsed)
