"""Many rows of a quantized product through the dense matrix units (issue 39).

torch's int4pack kernel (``qlinear``) reads the weights once a step but
computes at one flat rate from a few rows on (~160 GFLOP/s on 2 Zen 4
cores), where a bfloat16 GEMM through oneDNN (AMX, AVX-512 BF16 or AVX2)
reaches 2-3x that. For a prompt chunk's many rows, ``DenseTiles`` decodes
``weight_tile_rows`` rows of the int4pack weights at a time to bfloat16 into
a scratch it reuses (never a whole second copy of a matrix) and multiplies
them with ``torch.mm``; the decoding is paid once a step and shared by all
the step's tiles of rows.

Bits (wire-2 §3.8, ``stage.batch``): a dense GEMM picks its kernel by its
shape, so the rows it takes are fixed by the chunk alone, never by the
step: whole tiles of ``TILE_ROWS`` positions aligned to absolute positions
(``dense_tile_rows``), each one ``torch.mm`` of one fixed shape. The rest —
decode rows, a chunk's unaligned ends, verify windows (whose rows must be
their decode steps' bits, wire-2 §3.16) — stays on the int4pack kernel. A
stage using this asks the scheduler to cut chunks at multiples of
``TILE_ROWS`` (``TorchStageModel.piece_align``), so a chunk's tiles are the
same whole or in pieces, and the stage stays ``row_invariant``.

Decoding a weight tile (all vectorised torch ops, timed in docs/models.md):
two bit operations on the packed bytes four at a time give the nibbles
(an int4pack block of ``B`` rows — 64 on AVX-512, 32 on AVX2,
``qlinear.int4pack_block`` — is a ``[cols, B / 2]`` byte matrix whose byte
``(c, r)`` holds rows ``r`` and ``r + B / 2`` of column ``c``), and one
``addcmul`` applies the (scale, zero) pairs in float32 while reading them in
``W.T``'s order, rounding once to bfloat16: the weights are the held ones
(int4pack's own numbers) rounded once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...stage.batch import PackedBatch

__all__ = [
    "TILE_ROWS",
    "DenseTiles",
    "StepRows",
    "dense_tile_rows",
    "scratch_bytes",
    "weight_tile_rows",
]

# Positions per tile of rows: one fixed GEMM shape, aligned to absolute positions.
TILE_ROWS = 64
_GROUP = 32  # values per (scale, zero) pair (formats.gguf.blocks.GROUP)
_BLOCK = 64  # weight rows decoded at once are a multiple of this
# A worker's decoded weights and nibbles at once: about this many bytes (3 a
# value; more for a matrix of over 16,384 columns: 64 rows at least).
_SCRATCH_TARGET = 3 * 1024 * 1024
_MAX_WEIGHT_TILE = 512


def weight_tile_rows(cols: int) -> int:
    """The weight rows decoded at once for a matrix of ``cols`` columns: the
    scratch near ``_SCRATCH_TARGET`` (measured: 256-512 rows decode as fast
    per value as whole matrices, and fewer torch calls than 64-row tiles)."""
    rows = _SCRATCH_TARGET // (3 * cols) // _BLOCK * _BLOCK
    return max(_BLOCK, min(_MAX_WEIGHT_TILE, rows))


def scratch_bytes(cols: int, workers: int = 1) -> int:
    """Bytes ``DenseTiles`` keeps for matrices of up to ``cols`` columns, per
    worker thread: the decoded tile (bfloat16), its nibbles (a byte each) and
    a float32 sum for a matrix held in two halves (``Q8_0``), plus one tile's
    output."""
    rows = weight_tile_rows(cols)
    return workers * (rows * cols * (2 + 1 + 4) + TILE_ROWS * rows * 4)


class StepRows(list[tuple[int, int]]):
    """Each batched entry's rows (``PackedBatch.entry_rows``, what a dense
    product is cut by) and the step's dense tiles with their kernel: what
    ``layers.product`` hands a quantized matrix."""

    def __init__(
        self, spans: Sequence[tuple[int, int]], tiles: list[tuple[int, int]], kernel: DenseTiles
    ) -> None:
        super().__init__(spans)
        self.tiles = tiles
        self.kernel = kernel


def dense_tile_rows(batch: PackedBatch[Any]) -> list[tuple[int, int]]:
    """The packed rows ``[lo, hi)`` of every whole aligned tile of positions
    in the step's chunks (ascending): ``[a, a + TILE_ROWS)`` with ``a`` a
    multiple of ``TILE_ROWS`` inside a chunk, per batch row. Verify windows
    have none: their rows must be their decode steps' bits (wire-2 §3.16)."""
    tiles: list[tuple[int, int]] = []
    for entry, lo, _ in batch.spans():
        if entry.logit_rows > 1:
            continue
        first = -(-entry.position // TILE_ROWS) * TILE_ROWS
        end = entry.position + entry.tokens
        for row in range(entry.batch):
            base = lo + row * entry.tokens - entry.position
            starts = range(first, end - TILE_ROWS + 1, TILE_ROWS)
            tiles += [(base + a, base + a + TILE_ROWS) for a in starts]
    return tiles


def _gaps(tiles: list[tuple[int, int]], rows: int) -> list[tuple[int, int]]:
    """The row spans ``[0, rows)`` not in ``tiles`` (ascending, disjoint)."""
    gaps, at = [], 0
    for lo, hi in tiles:
        if lo > at:
            gaps.append((at, lo))
        at = hi
    if at < rows:
        gaps.append((at, rows))
    return gaps


class _Scratch(threading.local):
    """One worker thread's buffers (by name), None until it first needs one."""

    def __init__(self) -> None:
        self.buffers: dict[str, Any] | None = None


class DenseTiles:
    """A stage's dense-tile kernel: its workers and their scratch.

    The weight tiles of a product are shared out among as many worker
    threads as the step's ``torch.get_num_threads()``, each computing
    single-threaded: its tiles' GEMMs are then
    one shape on one thread whatever the step's thread count (a row's bits are
    its own, wire-2 §3.8), and a product is not hundreds of OpenMP regions
    whose barriers each wait for both cores (on a shared machine at load 7,
    2-thread regions made it 4x slower than int4pack; measured). Each worker
    keeps its own scratch (``scratch_bytes``)."""

    def __init__(self, block: int) -> None:
        self.block = block  # int4pack's rows per packed block here (32 or 64)
        self._local = _Scratch()
        self._scratches: list[dict[str, Any]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._workers = 0

    @property
    def nbytes(self) -> int:
        return sum(int(b.numel() * b.element_size()) for s in self._scratches for b in s.values())

    def _buffer(self, torch: Any, name: str, numel: int, dtype: Any) -> Any:
        buffers = self._local.buffers
        if buffers is None:
            buffers = self._local.buffers = {}
            self._scratches.append(buffers)  # list.append is atomic under the GIL
        held = buffers.get(name)
        if held is None or held.numel() < numel:
            held = buffers[name] = torch.empty(numel, dtype=dtype)
        return held[:numel]

    def _pool_of(self, torch: Any, workers: int) -> ThreadPoolExecutor:
        """At least ``workers`` single-threaded workers: the pool grows (a new
        one) and never shrinks, a step granted fewer threads using fewer."""
        if self._pool is not None and self._workers >= workers:
            return self._pool
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._local, self._scratches = _Scratch(), []
        own = torch.get_num_threads()
        started = threading.Barrier(workers)
        self._pool = ThreadPoolExecutor(
            workers, "dense-tiles", initializer=torch.set_num_threads, initargs=(1,)
        )
        # Start them all now, then give torch's process-wide default back (a
        # new thread's count starts from the last one set).
        list(self._pool.map(lambda _: started.wait(), range(workers)))
        torch.set_num_threads(own)
        self._workers = workers
        return self._pool

    def matmul(
        self,
        torch: Any,
        flat: Any,
        parts: Sequence[tuple[Any, Any]],
        tiles: list[tuple[int, int]],
        *,
        int4pack: Callable[[Any], Any],
    ) -> Any:
        """``flat @ W.T`` (``flat`` bfloat16 ``[rows, cols]``, W the sum of the
        int4pack ``parts``): ``tiles`` through the dense GEMM, the other rows
        through ``int4pack`` (the matrix's own kernel call), in its output
        dtype (float32 for two parts), so those rows keep its very bits."""
        rows, cols = flat.shape
        n_out = parts[0][0].shape[0]
        out = torch.empty((rows, n_out), dtype=flat.dtype if len(parts) == 1 else torch.float32)
        gaps = _gaps(tiles, rows)
        if gaps:
            pieces = [flat[lo:hi] for lo, hi in gaps]
            rest = int4pack(pieces[0] if len(gaps) == 1 else torch.cat(pieces))
            at = 0
            for lo, hi in gaps:
                out[lo:hi] = rest[at : at + hi - lo]
                at += hi - lo
        step = weight_tile_rows(cols)
        starts = iter(range(0, n_out, step))
        taking = threading.Lock()

        def work(_: int) -> None:
            """Weight tiles, one after another, until none is left."""
            with torch.inference_mode():
                while True:
                    with taking:
                        n0 = next(starts, None)
                    if n0 is None:
                        return
                    n1 = min(n_out, n0 + step)
                    w = self._decode(torch, parts, n0, n1)
                    for lo, hi in tiles:
                        # One shape, one thread, every tile: a row's bits are its own.
                        if out.dtype == w.dtype:
                            torch.mm(flat[lo:hi], w, out=out[lo:hi, n0:n1])
                        else:
                            out[lo:hi, n0:n1] = torch.mm(flat[lo:hi], w)

        workers = min(max(1, torch.get_num_threads()), -(-n_out // step))
        list(self._pool_of(torch, workers).map(work, range(workers)))
        return out

    def _decode(self, torch: Any, parts: Sequence[tuple[Any, Any]], n0: int, n1: int) -> Any:
        """Weight rows ``[n0, n1)`` as bfloat16 ``[cols, n1 - n0]`` (``W.T``'s
        columns, a view of the scratch)."""
        n = n1 - n0
        cols = parts[0][0].shape[1] * 2
        w = self._buffer(torch, "w", cols * n, torch.bfloat16)
        target = w.view(cols // _GROUP, _GROUP, n // self.block, self.block)
        if len(parts) == 1:
            scale, zero = _pairs(torch, parts[0][1], n0, n1, self.block)
            q = self._nibbles(torch, parts[0][0], n0, n1, "q")
            torch.addcmul(zero, q, scale, out=target)  # float32 q s + z, rounded once
            return w.view(cols, n)
        # Halves of very different sizes (Q8_0): summed in float32, rounded once.
        acc = self._buffer(torch, "acc", cols * n, torch.float32).view(target.shape)
        for i, (packed, pairs) in enumerate(parts):
            scale, zero = _pairs(torch, pairs, n0, n1, self.block)
            q = self._nibbles(torch, packed, n0, n1, "q")
            if i == 0:
                torch.addcmul(zero, q, scale, out=acc)
            else:
                acc.addcmul_(q, scale).add_(zero)
        target.copy_(acc)
        return w.view(cols, n)

    def _nibbles(self, torch: Any, packed: Any, n0: int, n1: int, name: str) -> Any:
        """The nibbles ``q`` (uint8) of weight rows ``[n0, n1)``, as a view
        ``[groups, 32, blocks, B]`` of ``W.T`` (``_decode``'s target). Two
        bit operations on 4 bytes at a time, in the packing's own order: a
        ``B``-row block's bytes are ``[cols, B / 2]``, byte ``(c, r)`` holding
        rows ``r`` (low nibble) and ``r + B / 2`` (high) of column ``c``."""
        block = self.block
        cols, blocks = packed.shape[1] * 2, (n1 - n0) // block
        words = packed[n0:n1].view(torch.int32).view(blocks, cols, block // 8)
        q = self._buffer(torch, name, blocks * cols * block, torch.uint8)
        halves = q.view(torch.int32).view(blocks, cols, 2, block // 8)
        torch.bitwise_and(words, 0x0F0F0F0F, out=halves[:, :, 0])
        torch.bitwise_right_shift(words, 4, out=halves[:, :, 1]).bitwise_and_(0x0F0F0F0F)
        return q.view(blocks, cols // _GROUP, _GROUP, block).permute(1, 2, 0, 3)


def _pairs(torch: Any, pairs: Any, n0: int, n1: int, block: int) -> tuple[Any, Any]:
    """The scale and the zero less 8 scales of rows ``[n0, n1)``, float32
    ``[groups, 1, blocks, block]`` (contiguous: a strided broadcast is 8x slower)."""
    groups, n = pairs.shape[0], n1 - n0
    scale = pairs[:, n0:n1, 0].float().contiguous()
    zero = pairs[:, n0:n1, 1].float() - 8 * scale
    shape = (groups, 1, n // block, block)
    return scale.view(shape), zero.view(shape)
